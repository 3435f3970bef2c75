"""Exact alignment of two tokenizations of one text, for a teacher with another tokenizer.

The student wrote a completion as its own tokens; a teacher with another tokenizer can only
score the same *text* as its tokens. A student token and a teacher token rarely cover the same
characters, but wherever both tokenizations have a token boundary at the same character, the
text before it is the same on both sides. The aligned spans are the pieces between consecutive
shared boundaries: the smallest pieces on which both sides agree. Chain rule: the teacher's
logprob of a span is exactly the sum of its tokens' logprobs, so the spans' values add up to the
teacher's logprob of the whole text (as the teacher tokenizes it).

A span that holds one student token gives that token the teacher's value exactly. A span of k > 1
student tokens has no teacher value per token (the teacher never saw those boundaries): each gets
an equal share, value / k. That keeps the span's sum, so the sequence's reverse-KL estimate
(teacher minus student, summed) is exact; only the credit among the k tokens of one span is a
choice, and an equal share favours no position. With equal tokenizations every span is one token
and the values pass through unchanged (x / 1 == x).

`token_ends` finds each token's end in the decoded text. A token that ends inside a character
(a byte-fallback piece of a multi-byte character) has no end there (None): it never bounds a
span, and joins the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def token_ends(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[int | None]]:
    """(the decoded text of `ids`, the character end of each token in it, or None where a prefix
    of the ids does not decode to a prefix of the text: a token that ends mid-character)."""
    text = decode(tokenizer, ids)
    ends: list[int | None] = []
    for i in range(len(ids)):
        prefix = decode(tokenizer, ids[: i + 1])
        ends.append(len(prefix) if text.startswith(prefix) else None)
    # A decoded prefix can stop short of a character the next token completes; keep only ends
    # that never move backwards.
    highest = 0
    for i, end in enumerate(ends):
        if end is not None and end < highest:
            ends[i] = None
        elif end is not None:
            highest = end
    if ids:
        ends[-1] = len(text)  # the last token ends the text, whatever its prefix decoded to
    return text, ends


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of `ids`, every id kept and no spaces tidied: the characters the ids stand for."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class SpanAlignment:
    """Aligned spans of two tokenizations: span i is student tokens `student[i]` (a half-open range
    of token indices) and teacher tokens `teacher[i]`, covering the same characters."""

    student: tuple[tuple[int, int], ...]
    teacher: tuple[tuple[int, int], ...]

    def teacher_per_student_token(self, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        """The teacher's logprob per student token: each span's sum of teacher token logprobs,
        shared equally among the span's student tokens (one token: its exact value), float64."""
        values = teacher_logprobs.double()
        out = torch.empty(self.student[-1][1] if self.student else 0, dtype=torch.float64)
        for (s0, s1), (t0, t1) in zip(self.student, self.teacher):
            out[s0:s1] = values[t0] if (s1 - s0, t1 - t0) == (1, 1) else values[t0:t1].sum() / (s1 - s0)
        return out

    @property
    def one_to_one(self) -> bool:
        """Every span is one token on each side: the teacher scored the student's own boundaries."""
        return all(s1 - s0 == 1 and t1 - t0 == 1 for (s0, s1), (t0, t1) in zip(self.student, self.teacher))


def align_spans(student_ends: Sequence[int | None], teacher_ends: Sequence[int | None]) -> SpanAlignment:
    """The smallest spans whose boundaries both tokenizations share, from each token's end
    (`token_ends`). Both must end the same text: the last ends are equal."""
    if not student_ends or not teacher_ends:
        if student_ends or teacher_ends:
            raise ValueError("one tokenization is empty and the other is not")
        return SpanAlignment((), ())
    if student_ends[-1] != teacher_ends[-1] or student_ends[-1] is None:
        raise ValueError(f"the tokenizations end at different characters ({student_ends[-1]} vs {teacher_ends[-1]})")
    shared = {end for end in student_ends if end is not None} & {end for end in teacher_ends if end is not None}
    student_spans, teacher_spans = _spans(student_ends, shared), _spans(teacher_ends, shared)
    assert len(student_spans) == len(teacher_spans), "one boundary set cuts both sides into as many spans"
    return SpanAlignment(tuple(student_spans), tuple(teacher_spans))


def _spans(ends: Sequence[int | None], shared: set[int]) -> list[tuple[int, int]]:
    """Token-index ranges cut after every token whose end is a shared boundary. A boundary shared
    by two tokens of one side (an empty token between them) cuts once, at the first."""
    spans, start, used = [], 0, set()
    for i, end in enumerate(ends):
        if end in shared and end not in used and (i == len(ends) - 1 or ends[i + 1] != end):
            spans.append((start, i + 1))
            start = i + 1
            used.add(end)
    return spans
