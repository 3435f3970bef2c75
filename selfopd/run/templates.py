"""A run's own copy of the templates it renders from (RUN/templates/).

Editing a template in `prompts/` after a run must not change what `selfopd diagnose`, the
notebooks or a resumed run render for that run: the run folder keeps the text of every
template its config names (and of the templates those include or extend), and reads them
back by the names the config uses. `index.json` maps each config name to its copy and to
the name reports showed for it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable

import jinja2
from jinja2 import meta as jinja_meta

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.config import TrainConfig
from selfopd.templating.templates import PROMPTS_DIR, PromptTemplate, load_template

INDEX = "index.json"


def config_template_names(config: TrainConfig) -> list[str]:
    """Every template a run of `config` may render: the student's, and each teacher's and its
    fallback for rollouts without a sibling demonstration."""
    names = [config.data.student_template, config.teacher.template, config.teacher.demonstration_fallback]
    for teacher in config.teachers.values():  # [teachers.NAME]
        names += [teacher.template, teacher.demonstration_fallback]
    return list(dict.fromkeys(names))


def save_run_templates(folder: Path, names: Iterable[str]) -> None:
    """Copy each named template (and what it includes) into `folder`; names already kept
    there stay as they are, so a resumed run keeps the texts it started with. Shipped
    templates keep their place under `prompts/`; others go under `local/`."""
    index_path = folder / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    for name in names:
        if name in index:
            continue
        template = load_template(name)
        for target, text in _sources(template).items():
            (folder / target).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(folder / target, text)
        index[name] = {"file": _target(template.path, template.path.parent).as_posix(), "name": template.name}
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(index_path, index)


def load_run_template(run_dir: Path, name: str) -> PromptTemplate:
    """The template `name` as the run at `run_dir` rendered it: its own copy when it kept
    one, else the current file (runs made before runs kept copies)."""
    folder = Path(run_dir) / "templates"
    index_path = folder / INDEX
    entry = json.loads(index_path.read_text()).get(name) if index_path.is_file() else None
    if entry is None:
        return load_template(name)
    template = load_template(folder / entry["file"], root=folder)
    return dataclasses.replace(template, name=entry["name"])


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
        sources[target] = current.read_text()
        for reference in jinja_meta.find_referenced_templates(environment.parse(sources[target])):
            if reference is None:  # a name computed while rendering: nothing to copy ahead
                continue
            try:
                pending.append(Path(environment.loader.get_source(environment, reference)[1]).resolve())
            except jinja2.TemplateNotFound:  # rendering reports it, naming the template
                continue
    return sources
