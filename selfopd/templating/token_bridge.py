"""A teacher with its own tokenizer and chat template (`teacher.tokenizer = 'own'`): the student's
completion as the teacher's tokens, and the teacher's logprobs back onto the student's tokens.

The teacher is prompted through its own chat template and scores the completion's *text* as its
own tokenizer writes it; `selfopd.templating.token_alignment` carries each aligned span's value
back (exact per span; a span of several student tokens shares it equally). Three things would
silently misalign and are checked instead:

- the text must re-encode to itself under the teacher's tokenizer (normalisation, byte fallback
  and unknown characters break this): a completion that does not is masked (no teacher signal)
  and counted, never scored against a different text;
- a special token inside the completion (other than the end of the turn) has no text: masked too;
- each chat template must end its generation prompt exactly where the assistant's text starts,
  and close the turn with one token right after it; `open_bridge` renders a conversation with a
  known answer on both sides and refuses a template that does not. The student's end-of-turn
  token, when it stopped, is scored as the teacher's own end-of-turn token: a span of its own.

A teacher whose tokenizer reads every student id the same (`check_tokenizers_compatible` passes)
scores the student's exact ids: re-encoding the text would only trade the student's tokenization
for the canonical one, so such a bridge gives the same numbers as `teacher.tokenizer = 'student'`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

import torch

from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import Message
from selfopd.templating.token_alignment import SpanAlignment, align_spans, decode, token_ends
from selfopd.templating.tokenizer_check import CHAT_PROBES, TokenizerMismatch, check_tokenizers_compatible

BOUNDARY_ANSWER = "Sentinel answer: 42."  # no leading space or newline: it starts right after the header


class ChatBoundaryError(ValueError):
    """A chat template whose generation prompt does not end where the assistant's text starts."""


@dataclass(frozen=True)
class Bridged:
    """One student completion for the teacher: its ids in the teacher's vocabulary and the spans
    that carry the teacher's logprobs back, or `problem` (why it cannot be aligned: masked)."""

    teacher_ids: list[int]
    alignment: SpanAlignment | None
    problem: str | None = None

    def student_logprobs(self, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        """The teacher's logprob per student token (float32, as every teacher score is)."""
        assert self.alignment is not None, "a masked completion has no teacher logprobs"
        return self.alignment.teacher_per_student_token(teacher_logprobs).float()


@dataclass(frozen=True)
class TokenBridge:
    """The student's and the teacher's tokenizers, and each one's end-of-turn token."""

    student: Any
    teacher: Any
    student_end: int
    teacher_end: int
    shared_ids: bool  # the teacher reads every student id the same: it scores the student's own ids
    teacher_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the teacher's chat-template arguments

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The teacher's prompt through its own chat template, with its own arguments."""
        return self.chat.prompt_ids(messages)

    @cached_property
    def chat(self) -> ChatFormat:
        """The teacher's chat format: its own tokenizer and chat-template arguments."""
        return ChatFormat(self.teacher, self.teacher_kwargs)

    def completion(self, completion_ids: Sequence[int]) -> Bridged:
        """The student's completion as the teacher's ids; the end-of-turn token, when the student
        stopped, becomes the teacher's own."""
        ids = list(completion_ids)
        specials = set(self.student.all_special_ids)
        stopped = bool(ids) and ids[-1] in specials  # its end of turn, or another stop token: the turn ends
        body = ids[:-1] if stopped else ids
        if self.shared_ids:
            alignment = SpanAlignment(tuple((i, i + 1) for i in range(len(ids))), tuple((i, i + 1) for i in range(len(ids))))
            return Bridged(ids, alignment)
        inner = [i for i in body if i in specials]
        if inner:
            return Bridged([], None, f"special token {decode(self.student, inner[:1])!r} inside the completion")
        text, student_ends = token_ends(self.student, body)
        teacher_body = self.teacher.encode(text, add_special_tokens=False)
        teacher_text, teacher_ends = token_ends(self.teacher, teacher_body)
        if teacher_text != text:
            where = next((i for i, (a, b) in enumerate(zip(text, teacher_text)) if a != b), min(len(text), len(teacher_text)))
            return Bridged([], None, f"the text does not re-encode to itself under the teacher's tokenizer (from "
                           f"character {where}: {text[where:where + 12]!r} became {teacher_text[where:where + 12]!r})")
        alignment = align_spans(student_ends, teacher_ends)
        if stopped:  # the end of the turn: one span of its own
            n, m = len(body), len(teacher_body)
            alignment = SpanAlignment(alignment.student + ((n, n + 1),), alignment.teacher + ((m, m + 1),))
            teacher_body = teacher_body + [self.teacher_end]
        return Bridged(teacher_body, alignment)


def open_bridge(student: Any, teacher: Any, teacher_vocab_size: int, student_name: str = "student",
                teacher_name: str = "teacher", student_kwargs: Mapping[str, Any] | None = None,
                teacher_kwargs: Mapping[str, Any] | None = None) -> TokenBridge:
    """The bridge between two tokenizers, once both chat templates pass the boundary check, each
    with its role's chat-template arguments (`*_kwargs`)."""
    student_kwargs, teacher_kwargs = dict(student_kwargs or {}), dict(teacher_kwargs or {})
    student_end = turn_end(student, student_name, student_kwargs)
    teacher_end = turn_end(teacher, teacher_name, teacher_kwargs)
    try:
        check_tokenizers_compatible(student, teacher, teacher_vocab_size, student_name, teacher_name, teacher_kwargs)
        shared = True
    except TokenizerMismatch:
        shared = False
    return TokenBridge(student, teacher, student_end, teacher_end, shared, teacher_kwargs)


def turn_end(tokenizer: Any, name: str, template_kwargs: Mapping[str, Any] | None = None) -> int:
    """The token a chat template closes the assistant's turn with, after checking on each probe
    conversation that the generation prompt ends exactly where the assistant's text starts
    (rendered with `template_kwargs`, the role's chat-template arguments)."""
    chat = ChatFormat(tokenizer, template_kwargs or {})
    ends = set()
    for label, messages in CHAT_PROBES:
        prompt = chat.prompt_ids(messages)
        answer = tokenizer.encode(BOUNDARY_ANSWER, add_special_tokens=False)
        whole = chat.ids([*messages, {"role": "assistant", "content": BOUNDARY_ANSWER}], False)
        if whole[: len(prompt)] != prompt:
            at = next(i for i, (a, b) in enumerate(zip(whole, prompt)) if a != b) if len(whole) >= len(prompt) else len(whole)
            raise ChatBoundaryError(
                f"{name}'s chat template: the generation prompt is not how a finished conversation begins "
                f"({label} probe, from token {at}: generation prompt {decode(tokenizer, prompt[at:])!r}, finished "
                f"{decode(tokenizer, whole[at:at + len(prompt) - at])!r}); a completion appended to it would not read "
                "as the assistant's answer")
        after = whole[len(prompt):]
        if after[: len(answer)] != answer or len(after) <= len(answer):
            raise ChatBoundaryError(
                f"{name}'s chat template: the assistant's text {BOUNDARY_ANSWER!r} does not follow the generation "
                f"prompt as its own tokens ({label} probe: after the prompt comes {decode(tokenizer, after)!r})")
        ends.add(after[len(answer)])
    if len(ends) != 1:
        raise ChatBoundaryError(f"{name}'s chat template closes the assistant's turn with different tokens "
                                f"({sorted(ends)}) in different conversations")
    return ends.pop()
