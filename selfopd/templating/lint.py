"""Checks a template before a run spends compute on it.

For each template: it renders on a sample of the dataset, the variables it uses exist
for those rows, a student template never touches privileged variables, and a teacher
template does not put the reference answer where copying it is the shortcut.

The copying heuristic: the reference answer appears verbatim (as a whole token) after the
student's question in the teacher's prompt, i.e. it sits right before the generation
point (when the template rewrites the question, after its last `tail_chars` characters).
A teacher prompted that way gains its advantage on the answer tokens by copying, which
the student can never do: the privileged illusion. A reference placed before the
question, with an instruction to reason, is not flagged.

The chat-template check (`boundary_findings`): the teacher scores the student's completion
right after its own generation prompt, so the text the generation prompt adds (the assistant
header, and for thinking models e.g. an empty `<think></think>` block) must be the same for both
roles. It renders the probe conversations with each role's chat-template arguments and
compares what the generation prompt adds; arguments the template ignores are not flagged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from selfopd.data.example import Example
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import (
    OPTIONAL_FIELDS,
    PROMPTS_DIR,
    SAMPLE_DEMONSTRATION,
    STUDENT_VARIABLES,
    TEACHER_VARIABLES,
    PromptTemplate,
    TemplateError,
    TemplateLimitError,
    privileged_fields,
    render_student,
    render_teacher,
    uses_demonstration,
)
from selfopd.templating.tokenizer_check import CHAT_PROBES

Level = Literal["error", "warning"]
PRIVILEGED_VARIABLES = frozenset(TEACHER_VARIABLES) - frozenset(STUDENT_VARIABLES)
ATTEMPT_PLACEHOLDER = "I think the answer is \\boxed{0}."  # a stand-in student attempt for feedback templates


@dataclass(frozen=True)
class Finding:
    level: Level
    template: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.template}: {self.message}"


def template_role(template: PromptTemplate) -> Literal["student", "teacher"]:
    """Templates under prompts/teacher, or using privileged variables, are teacher templates."""
    if template.path.is_relative_to(PROMPTS_DIR / "teacher") or template.variables & PRIVILEGED_VARIABLES:
        return "teacher"
    return "student"


def lint_template(
    template: PromptTemplate,
    student_template: PromptTemplate,
    examples: Sequence[Example],
    tail_chars: int = 80,
) -> list[Finding]:
    """All findings for one template on a sample of examples (empty list: clean)."""
    role = template_role(template)
    if role == "student":
        leaked = sorted(template.variables - set(STUDENT_VARIABLES))
        if leaked:
            return [Finding("error", template.name, f"student template uses privileged or unknown variables: {', '.join(leaked)}")]
    findings = [Finding("error", template.name, problem) for problem in missing_fields(template, examples)]
    if findings:
        return findings
    for example in examples:
        try:
            student_messages = render_student(student_template, example)
            if role == "student":
                continue
            attempt, feedback = _feedback_for(example) if {"attempt", "feedback"} & template.variables else (None, None)
            demonstration = SAMPLE_DEMONSTRATION if uses_demonstration(template) else None
            teacher_messages = render_teacher(template, example, student_messages, attempt, feedback, demonstration)
        except TemplateError as error:
            findings.append(Finding("error", template.name, f"row {example.id}: {error}"))
            if isinstance(error, TemplateLimitError):
                break  # a template past a limit is past it on every row: once is enough, and fast
            continue
        question = student_messages[-1]["content"]
        if answer_follows_question(teacher_messages[-1]["content"], question, example.answer, tail_chars):
            findings.append(
                Finding(
                    "warning",
                    template.name,
                    f"row {example.id}: the reference answer {example.answer!r} appears verbatim after the question, "
                    "right before the generation point; copying it is the teacher's shortcut (privileged illusion)",
                )
            )
            break  # one warning per template is enough to act on
    return findings


def answer_follows_question(teacher_text: str, question: str, answer: str, tail_chars: int = 80) -> bool:
    """True when `answer` occurs as a whole token after the end of `question` in
    `teacher_text` (or, if the question is not there verbatim, in its last `tail_chars`)."""
    answer = answer.strip()
    if not answer:
        return False
    start = teacher_text.rfind(question) + len(question) if question and question in teacher_text else len(teacher_text) - tail_chars
    pattern = rf"(?<![\w.]){re.escape(answer)}(?!\w)"
    return re.search(pattern, teacher_text[max(start, 0):]) is not None


def missing_fields(template: PromptTemplate, examples: Sequence[Example]) -> list[str]:
    """Privileged fields the template uses that some sampled rows lack."""
    problems = []
    for field in OPTIONAL_FIELDS:
        if field in template.variables:
            rows = [e.id for e in examples if field not in privileged_fields(e)]
            if rows:
                problems.append(f"uses {field!r} but {len(rows)} of {len(examples)} sampled rows have none (e.g. {rows[0]})")
    return problems


def _feedback_for(example: Example) -> tuple[str, str]:
    from selfopd.verifiers import verify_example

    return ATTEMPT_PLACEHOLDER, verify_example(ATTEMPT_PLACEHOLDER, example).feedback


def generation_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], template_kwargs: Mapping[str, Any]) -> str:
    """The text the chat template's generation prompt adds after `messages` with these arguments:
    what the completion is scored right after (the whole prompt when the two renderings diverge)."""
    chat = ChatFormat(tokenizer, template_kwargs)
    whole, conversation = chat.text(messages, True), chat.text(messages, False)
    return whole[len(conversation):] if whole.startswith(conversation) else whole


def boundary_findings(tokenizer: Any, student_kwargs: Mapping[str, Any], teacher_kwargs: Mapping[str, Any],
                      teacher: str = "teacher") -> list[Finding]:
    """One warning when the teacher's chat-template arguments change what the generation prompt adds
    (measured by rendering the probe conversations with `tokenizer`); none when they render alike."""
    if dict(student_kwargs) == dict(teacher_kwargs):
        return []
    for label, messages in CHAT_PROBES:
        student = generation_prompt(tokenizer, messages, student_kwargs)
        theirs = generation_prompt(tokenizer, messages, teacher_kwargs)
        if student != theirs:
            return [Finding("warning", f"{teacher}.chat_template_kwargs", (
                f"the teacher's generation prompt ends {theirs!r} ({dict(teacher_kwargs)}), the student's {student!r} "
                f"({dict(student_kwargs)}) on the {label} probe: the teacher scores the student's completion from a "
                "different point"))]
    return []
