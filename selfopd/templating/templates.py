"""Student and privileged-teacher prompts, rendered from Jinja templates in `prompts/`.

A template renders to chat messages. It may define `{% block system %}` and
`{% block user %}`; without blocks the whole text is the user message. A teacher
template that defines no system block reuses the student's system message, so with
the empty-context control (`teacher/empty`) teacher and student prompts are identical.

Templates run in Jinja's immutable sandbox with StrictUndefined: a template shared by a
colleague cannot call into Python, and a misspelt or unavailable variable is an error
that names the file, the line and the variable instead of rendering an empty string. Any
other error of a template's own code (an include outside the search path, `1/0`, a
`range(10**9)` or `'x' * 10**9` the sandbox refuses) is a TemplateError naming file and
line too. Rendering has no time limit: nested loops can still keep a core busy.

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

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jinja2
from jinja2 import meta as jinja_meta
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from selfopd.data.example import Example

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


class TemplateError(ValueError):
    """A template that cannot be found, parsed or rendered; the message names the file."""


# What expressions in a template can raise while rendering: the template's fault, reported
# as a TemplateError with its file and line rather than a traceback from inside Jinja.
RENDER_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                 MemoryError)
MAX_REPEAT_LENGTH = 1_000_000  # `'x' * n` in a template: longer is a mistake or an attack
MAX_POWER_DIGITS = 100_000  # `a ** b` of integers: 9 ** (9 ** 9) would run for hours


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
            blocks = self.template.blocks
            if "user" not in blocks:
                return [{"role": "user", "content": self.template.render(variables).strip()}]
            context = self.template.new_context(variables)
            messages = []
            for role in ("system", "user"):
                if role in blocks:
                    messages.append({"role": role, "content": "".join(blocks[role](context)).strip()})
            return messages
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
                f"(searched {self.path.parent} and {PROMPTS_DIR}; a path with '..' is refused)"
            ) from None
        except RENDER_ERRORS as error:  # the template's own code failed (1/0, range(10**9), ...)
            raise TemplateError(f"{_template_location(error, self.path)}: {type(error).__name__}: {error}") from None


def load_template(name_or_path: str | os.PathLike[str], root: Path | None = None) -> PromptTemplate:
    """Load `teacher/hints` (a name under `prompts/`, `.jinja` optional) or a file path.
    `root`: a folder searched before `prompts/`, for the name and for includes (a run's
    own copies of its templates, RUN/templates/)."""
    path = _find_template(str(name_or_path), root)
    environment = _environment(path.parent, root)
    try:
        template = environment.get_template(path.name)
        parsed = environment.parse(path.read_text(), name=path.name, filename=str(path))
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


def prompt_token_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` through the model's own chat template, ending with the
    assistant header: appending a completion's exact ids gives a valid sequence."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def _user_content(messages: Sequence[Message]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if len(users) != 1:
        raise TemplateError(f"expected exactly one user message from the student template, got {len(users)}")
    return users[0]


def _find_template(name: str, root: Path | None = None) -> Path:
    searched = ([root / name, root / f"{name}.jinja"] if root is not None else [])
    candidates = [*searched, Path(name), PROMPTS_DIR / name, PROMPTS_DIR / f"{name}.jinja"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise TemplateError(
        f"no template {name!r}: not a file and not one of the shipped templates ({', '.join(list_templates())})"
    )


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, which only bounds range(), plus bounds on the two operators
    that can exhaust memory or a core in one expression: `*` repeating a string or list, and
    `**` of integers."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if _too_costly(operator, left, right):
            raise SecurityError(f"{operator!r} on {type(left).__name__} and {type(right).__name__} would be too "
                                "large to compute in a template")
        return super().call_binop(context, operator, left, right)


def _too_costly(operator: str, left: Any, right: Any) -> bool:
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                return len(sequence) * count > MAX_REPEAT_LENGTH
        return False
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return right * math.log10(abs(left)) > MAX_POWER_DIGITS
    return False


def _environment(template_dir: Path, root: Path | None = None) -> ImmutableSandboxedEnvironment:
    # Both the template's folder and prompts/ are searchable, so shipped templates can be
    # extended or included from templates kept elsewhere.
    roots = [template_dir, *([root] if root is not None else []), PROMPTS_DIR]
    loader = jinja2.FileSystemLoader([str(folder) for folder in roots])
    environment = _Sandbox(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        autoescape=False,
    )
    del environment.globals["lipsum"]  # lorem ipsum of any length: no use in a prompt, lipsum(10**9) hangs
    return environment


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
