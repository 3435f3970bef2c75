"""A run's own copy of the templates it renders from (RUN/templates/).

Editing a template in `prompts/` after a run must not change what `selfopd diagnose`, the
notebooks or a resumed run render for that run: the run folder keeps the text of every
template its config names (and of the templates those include or extend), and reads them
back by the names the config uses. `index.json` maps each config name to its copy and to
the name reports showed for it. A run folder may come from elsewhere: a copy it names must lie
inside its templates/ folder (no absolute path, no `..`, no link leading out), else the
template is refused with one line naming index.json and the entry."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

import jinja2
from jinja2 import meta as jinja_meta

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.config import TrainConfig
from selfopd.templating.template_files import IncludeRefused, TemplateFileError, read_template_file
from selfopd.templating.templates import PROMPTS_DIR, PromptTemplate, TemplateError, load_template

INDEX = "index.json"


def config_template_names(config: TrainConfig) -> list[str]:
    """Every template a run of `config` may render: the student's, the in-run eval's
    (eval.student_template, when set), and each teacher's and its fallback for rollouts without a
    sibling demonstration."""
    names = [config.data.student_template, config.eval.template(config.data.student_template), config.teacher.template,
             config.teacher.demonstration_fallback]
    for teacher in config.teachers.values():  # [teachers.NAME]
        names += [teacher.template, teacher.demonstration_fallback]
    return list(dict.fromkeys(names))


def save_run_templates(folder: Path, names: Iterable[str]) -> None:
    """Copy each named template (and what it includes) into `folder`; names already kept
    there stay as they are, so a resumed run keeps the texts it started with. Shipped
    templates keep their place under `prompts/`; others go under `local/`."""
    index = _read_index(folder)
    for name in names:
        if name in index:
            continue
        template = load_template(name)
        for target, text in _sources(template).items():
            if not (folder / target).parent.resolve().is_relative_to(folder.resolve()):  # a planted link
                raise TemplateError(f"{folder / target.parent}: leads outside {folder}; a run folder's templates "
                                    "must lie inside its templates/ folder")
            (folder / target).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(folder / target, text)
        index[name] = {"file": _target(template.path, template.path.parent).as_posix(), "name": template.name}
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / INDEX, index)


def load_run_template(run_dir: Path, name: str) -> PromptTemplate:
    """The template `name` as the run at `run_dir` rendered it: its own copy when it kept
    one, else the current file (runs made before runs kept copies)."""
    folder = Path(run_dir) / "templates"
    entry = _read_index(folder).get(name)
    if entry is None:
        return load_template(name)
    template = load_template(_kept_file(folder, name, entry), root=folder)
    return dataclasses.replace(template, name=entry["name"])


def _read_index(folder: Path) -> dict[str, Any]:
    """The folder's index.json (empty when there is none); one that is not a JSON object is an error."""
    path = folder / INDEX
    if not path.is_file():
        return {}
    try:
        index = json.loads(path.read_bytes())
    except (ValueError, OSError) as error:  # not JSON, not UTF-8, unreadable
        raise TemplateError(f"{path}: not a readable JSON index of templates: {error}") from None
    if not isinstance(index, dict):
        raise TemplateError(f"{path}: expected a JSON object of templates, got {type(index).__name__}")
    return index


def _kept_file(folder: Path, name: str, entry: Any) -> Path:
    """The copy an index entry names: a file inside `folder`, reached without leaving it."""
    where = f"{folder / INDEX}: entry {name!r}"
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("name"), str)
            and entry["name"].isprintable()):
        raise TemplateError(f"{where}: expected {{\"file\": PATH, \"name\": NAME}}, got {json.dumps(entry)[:200]}")
    relative = PurePosixPath(entry["file"])
    path = folder.joinpath(*relative.parts)
    if (relative.is_absolute() or ".." in relative.parts or "\\" in entry["file"] or not relative.parts
            or not path.resolve().is_relative_to(folder.resolve())):
        raise TemplateError(f"{where}: file {entry['file']!r} leads outside {folder}; a run folder's templates must "
                            "lie inside its templates/ folder")
    return path


def _target(path: Path, local_dir: Path) -> Path:
    shipped = PROMPTS_DIR.resolve()
    return path.relative_to(shipped) if path.is_relative_to(shipped) else Path("local") / path.relative_to(local_dir)


def _sources(template: PromptTemplate) -> dict[Path, str]:
    """The text of `template` and of every template it includes, imports or extends, found
    by the template's own loader (as rendering finds them), keyed by where the copy goes."""
    environment = template.template.environment
    sources: dict[Path, str] = {}
    pending = [template.path]
    while pending:
        current = pending.pop()
        target = _target(current, template.path.parent)
        if target in sources:
            continue
        try:
            sources[target] = read_template_file(current)
        except TemplateFileError as error:
            raise TemplateError(str(error)) from None
        for reference in jinja_meta.find_referenced_templates(environment.parse(sources[target])):
            if reference is None:  # a name computed while rendering: nothing to copy ahead
                continue
            try:
                pending.append(Path(environment.loader.get_source(environment, reference)[1]).resolve())
            except (jinja2.TemplateNotFound, IncludeRefused):  # rendering reports it, naming the template
                continue
    return sources
