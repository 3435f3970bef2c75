"""Student and privileged-teacher prompts, rendered from Jinja templates in `prompts/`.

A template renders to chat messages. It may define `{% block system %}` and
`{% block user %}`; without blocks the whole text is the user message. A teacher
template that defines no system block reuses the student's system message, so with
the empty-context control (`teacher/empty`) teacher and student prompts are identical.

Templates run in Jinja's immutable sandbox with StrictUndefined: a template shared by a
colleague cannot call into Python, and a misspelt or unavailable variable is an error
that names the file, the line and the variable instead of rendering an empty string. A
template includes, extends or imports only `.jinja` files of its own folder and of
`prompts/` (`template_files`), and rendering one prompt is bounded in size, work and CPU
time (`sandbox`). Any error of a template's own code (a refused include, `1/0`, a
`range(10**9)`, a value or prompt past a limit) is a TemplateError naming file and line.

Variables:
- student templates: `prompt`, `id`, `meta` (never the answer: the student cannot have it);
- teacher templates: the student's, plus `answer`, `student_prompt` (the rendered student
  user message), and when available `solution`, `hints` (list), `attempt` (the student's
  completion text), `feedback` (a verifier's sentence about that attempt) and
  `demonstration` (the text of another, correct sample of the same prompt from the same
  step). A rollout that has no demonstration is rendered with the run's fallback template
  (`teacher.demonstration_fallback`) instead: `render_teacher(..., fallback=...)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import jinja2
from jinja2 import meta as jinja_meta
from jinja2.sandbox import SecurityError

from selfopd.data.example import Example
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.errors import TemplateError, TemplateLimitError
from selfopd.templating.sandbox import MAX_RENDER_CHARS, LIMITS_DOC, RenderLimit, Sandbox, render_budget
from selfopd.templating.template_files import FolderLoader, IncludeRefused, TemplateFileError, read_template_file

Message = dict[str, str]


def _shipped_prompts_dir() -> Path:
    """The shipped templates: $SELFOPD_PROMPTS when set, the installed package data
    (selfopd/prompts/ in a wheel install), else the source tree's top-level prompts/."""
    if "SELFOPD_PROMPTS" in os.environ:
        return Path(os.environ["SELFOPD_PROMPTS"])
    installed = Path(__file__).resolve().parents[1] / "prompts"  # selfopd/prompts/
    return installed if installed.is_dir() else Path(__file__).resolve().parents[2] / "prompts"


PROMPTS_DIR = _shipped_prompts_dir()
STUDENT_VARIABLES = ("prompt", "id", "meta")
TEACHER_VARIABLES = STUDENT_VARIABLES + ("answer", "student_prompt", "solution", "hints", "fact_sheet", "attempt", "feedback",
                                          "demonstration")
OPTIONAL_FIELDS = ("solution", "hints", "fact_sheet")  # privileged fields only some data has
# A stand-in sibling demonstration, for rendering a template before any rollout exists
# (start-up checks, `selfopd prompts lint` and `render`).
SAMPLE_DEMONSTRATION = "Adding the two numbers step by step gives the final answer, \\boxed{0}."


# What expressions in a template can raise while rendering: the template's fault, reported
# as a TemplateError with its file and line rather than a traceback from inside Jinja.
RENDER_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                 MemoryError)


@dataclass(frozen=True)
class PromptTemplate:
    """A loaded template: its name for reports, its file, and the compiled Jinja template."""

    name: str
    path: Path
    template: jinja2.Template
    variables: frozenset[str]  # the variables its source refers to

    def render(self, variables: dict[str, Any]) -> list[Message]:
        """Render to chat messages; errors name this file, the line and the variable."""
        try:
            with render_budget():
                try:
                    return self._messages(variables)
                except Exception:
                    self.template.environment.handle_exception()  # frames of the template's file and lines
        except TemplateError:
            raise
        except RenderLimit as error:
            raise TemplateLimitError(f"{_template_location(error, self.path)}: {error}") from None
        except IncludeRefused as error:
            raise TemplateError(f"{_template_location(error, self.path)}: template {error}") from None
        except jinja2.UndefinedError as error:
            raise TemplateError(
                f"{_template_location(error, self.path)}: variable {error.message}; "
                f"available here: {', '.join(sorted(variables))}"
            ) from None
        except SecurityError as error:
            raise TemplateError(f"{_template_location(error, self.path)}: unsafe operation refused: {error}") from None
        except jinja2.TemplateNotFound as error:
            raise TemplateError(
                f"{_template_location(error, self.path)}: no template {error.name!r} to include or extend "
                f"(searched {self.path.parent} and {PROMPTS_DIR})"
            ) from None
        except RENDER_ERRORS as error:  # the template's own code failed (1/0, range(10**9), ...)
            raise TemplateError(f"{_template_location(error, self.path)}: {type(error).__name__}: {error}") from None

    def _messages(self, variables: dict[str, Any]) -> list[Message]:
        blocks = self.template.blocks
        if "user" not in blocks:
            return [{"role": "user", "content": self._text(self.template.generate(variables), 0)}]
        context = self.template.new_context(variables)
        messages: list[Message] = []
        for role in ("system", "user"):
            if role in blocks:
                messages.append({"role": role, "content": self._text(blocks[role](context), sum(
                    len(m["content"]) for m in messages))})
        return messages

    def _text(self, pieces: Iterable[str], before: int) -> str:
        """The rendered pieces joined, stopping once the prompt passes MAX_RENDER_CHARS."""
        text: list[str] = []
        for piece in pieces:
            text.append(piece)
            before += len(piece)
            if before > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"{self.path}: renders over {MAX_RENDER_CHARS:,} characters, the size limit "
                                         f"of a prompt ({LIMITS_DOC})")
        return "".join(text).strip()


def load_template(name_or_path: str | os.PathLike[str], root: Path | None = None) -> PromptTemplate:
    """Load `teacher/hints` (a name under `prompts/`, `.jinja` optional) or a file path.
    `root`: a folder searched before `prompts/`, for the name and for includes (a run's
    own copies of its templates, RUN/templates/)."""
    path = _find_template(str(name_or_path), root)
    environment = _environment(path.parent, root)
    try:
        source = read_template_file(path)
        code = environment.compile(source, path.name, str(path))
        template = environment.template_class.from_code(environment, code, environment.make_globals(None))
        parsed = environment.parse(source, name=path.name, filename=str(path))
    except TemplateFileError as error:
        raise TemplateError(str(error)) from None
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"{path}:{error.lineno}: template syntax error: {error.message}") from None
    variables = frozenset(jinja_meta.find_undeclared_variables(parsed))
    return PromptTemplate(name=_display_name(path, root), path=path, template=template, variables=variables)


def list_templates() -> list[str]:
    """Names of every template shipped in `prompts/`, e.g. `teacher/reference_answer`."""
    return sorted(str(p.relative_to(PROMPTS_DIR).with_suffix("")) for p in PROMPTS_DIR.rglob("*.jinja"))


def student_variables(example: Example) -> dict[str, Any]:
    return {"prompt": example.prompt, "id": example.id, "meta": example.meta}


def teacher_variables(
    example: Example,
    student_messages: Sequence[Message],
    attempt: str | None = None,
    feedback: str | None = None,
    demonstration: str | None = None,
) -> dict[str, Any]:
    """Everything a privileged teacher may see. Absent information stays undefined, so a
    template that needs it fails loudly rather than rendering 'None'."""
    variables = student_variables(example)
    variables["answer"] = example.answer
    variables["student_prompt"] = _user_content(student_messages)
    variables.update(privileged_fields(example))
    if attempt is not None:
        variables["attempt"] = attempt
    if feedback is not None:
        variables["feedback"] = feedback
    if demonstration is not None:
        variables["demonstration"] = demonstration
    return variables


def privileged_fields(example: Example) -> dict[str, Any]:
    """The data's optional privileged fields (`OPTIONAL_FIELDS`) that this example has; a missing
    or empty one is left out."""
    fields: dict[str, Any] = {}
    if example.solution:
        fields["solution"] = example.solution
    if example.hints:
        fields["hints"] = list(example.hints)
    if example.meta.get("fact_sheet"):  # a document about the question's entity (the kb: tasks)
        fields["fact_sheet"] = example.meta["fact_sheet"]
    return fields


def uses_demonstration(template: PromptTemplate) -> bool:
    """The template shows the teacher a sibling demonstration (the `demonstration` variable)."""
    return "demonstration" in template.variables


def check_student_template(template: PromptTemplate) -> None:
    """A student cannot see a sibling's answer: `demonstration` is a teacher variable."""
    if uses_demonstration(template):
        raise TemplateError(f"{template.path}: student template {template.name!r} uses 'demonstration', which "
                            "only a teacher template may use")


def render_student(template: PromptTemplate, example: Example) -> list[Message]:
    return template.render(student_variables(example))


def render_teacher(
    template: PromptTemplate,
    example: Example,
    student_messages: Sequence[Message],
    attempt: str | None = None,
    feedback: str | None = None,
    demonstration: str | None = None,
    fallback: PromptTemplate | None = None,
) -> list[Message]:
    """Teacher messages; the student's system message is kept unless the template has its own.
    A template that uses `demonstration`, given none, renders `fallback` instead (when given;
    else the missing variable is an error)."""
    if demonstration is None and fallback is not None and uses_demonstration(template):
        template = fallback
    messages = template.render(teacher_variables(example, student_messages, attempt, feedback, demonstration))
    student_system = [m for m in student_messages if m["role"] == "system"]
    if student_system and not any(m["role"] == "system" for m in messages):
        messages = student_system + messages
    return messages


def prompt_token_ids(tokenizer: Any, messages: Sequence[Message],
                     template_kwargs: Mapping[str, Any] = MappingProxyType({})) -> list[int]:
    """Token ids of `messages` through the model's own chat template, ending with the
    assistant header: appending a completion's exact ids gives a valid sequence.
    `template_kwargs`: the role's chat-template arguments, e.g. enable_thinking. A shorthand for
    tests and experiment scripts: selfopd's roles each hold their `ChatFormat` (`chat_format`)."""
    return ChatFormat(tokenizer, template_kwargs).prompt_ids(messages)


def _user_content(messages: Sequence[Message]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if len(users) != 1:
        raise TemplateError(f"expected exactly one user message from the student template, got {len(users)}")
    return users[0]


def _find_template(name: str, root: Path | None = None) -> Path:
    searched = ([root / name, root / f"{name}.jinja"] if root is not None else [])
    candidates = [*searched, Path(name), PROMPTS_DIR / name, PROMPTS_DIR / f"{name}.jinja"]
    for candidate in candidates:
        try:
            if candidate.is_file():
                return candidate.resolve()
        except OSError as error:  # a name past what the file system takes (ENAMETOOLONG)
            raise TemplateError(f"no template {name[:80]!r}{'...' if len(name) > 80 else ''} ({len(name)} characters): "
                                f"{error.strerror}; name a template file or one of the shipped templates") from None
    raise TemplateError(
        f"no template {name!r}: not a file and not one of the shipped templates ({', '.join(list_templates())})"
    )


def _environment(template_dir: Path, root: Path | None = None) -> Sandbox:
    # The template's folder, a run's templates/ and prompts/ are searchable, so shipped templates
    # can be extended or included from templates kept elsewhere.
    return Sandbox(
        loader=FolderLoader([template_dir, *([root] if root is not None else []), PROMPTS_DIR]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        autoescape=False,
    )


def _display_name(path: Path, root: Path | None = None) -> str:
    for folder in (root, PROMPTS_DIR):
        if folder is not None and path.is_relative_to(folder.resolve()):
            return str(path.relative_to(folder.resolve()).with_suffix(""))
    return str(path)


def _template_location(error: Exception, path: Path) -> str:
    """`file:line` where rendering failed. Jinja rewrites traceback frames to carry the
    template's file name and line, so the innermost such frame is the culprit (it may be
    a template that `path` includes or extends)."""
    location = f"{path}:?"
    traceback = error.__traceback__
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if filename.endswith(".jinja") or filename == str(path):
            location = f"{filename}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return location
