"""Which kind of text each completion token is: copied answer, format, epistemic word, other.

Classification works on text, then projects onto tokens through each token's character
span, so it does not depend on how a tokenizer splits words or numbers (SmolLM2 splits
"17" into "1" "7"; a word may be several pieces). A token belongs to the first class
that claims any of its characters, in this order:

  answer_copy   inside the student's final answer where it is the reference, or inside a
                word n-gram (`COPY_NGRAM` words) shared with the privileged-only text
  answer_slot   inside the student's final answer where it is not the reference
                (a wrong answer: where a copying teacher pulls hardest)

Only the final answer (the last place the extracted answer is written) is an answer token:
the operand 7 in "7 - 3 + 3 = 7" is part of the question, not a copy of the answer.
  epistemic     part of a word that voices doubt or checking (`EPISTEMIC_WORDS`)
  structural    whitespace, punctuation, operators, markup (`\\boxed`, tags), special tokens
  other         everything else: words and numbers of the reasoning itself
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

CLASSES = ("answer_copy", "answer_slot", "epistemic", "structural", "other")
ANSWER_CLASSES = ("answer_copy", "answer_slot")
COPY_NGRAM = 5  # words: shorter shared phrases are mostly ordinary wording ("the answer is")
EPISTEMIC_WORDS = frozenset(
    """wait hmm hm maybe perhaps actually alternatively seems seem seemingly might probably possibly
    likely unlikely unsure uncertain check checking recheck double-check verify verifying confirm
    reconsider mistake oops hold suppose guess""".split()
)
# Phrases that only make sense if the writer saw a hint, note or reference it was never given.
LEAK_PATTERN = re.compile(
    r"\b(?:the|a|this|that|your|my)\s+(?:hint|note|reference(?:\s+(?:answer|solution))?|worked\s+solution|"
    r"provided\s+(?:answer|solution)|given\s+answer|answer\s+key)\b"
    r"|\bfor\s+your\s+eyes\s+only\b|\bcorrect\s+final\s+answer\s+is\b|\b(?:i\s+was|you)\s+told\b"
    r"|\baccording\s+to\s+the\s+(?:hint|note|reference|solution)\b",
    re.IGNORECASE,
)
_WORD = re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)*|\d+(?:\.\d+)?|[^\w\s]")
_STRUCTURAL_TOKEN = re.compile(r"^\s*(?:[^\w\s]+|\\[A-Za-z]+|</?\w+>)?\s*$")


@dataclass(frozen=True)
class TokenPieces:
    """The completion text split at token boundaries: `pieces[i]` is token i's text and
    `spans[i]` its (start, end) in `text`."""

    text: str
    pieces: list[str]
    spans: list[tuple[int, int]]


def token_pieces(tokenizer: Any, completion_ids: Sequence[int]) -> TokenPieces:
    """Decode token by token with growing prefixes, so multi-byte characters split over
    tokens land on the token that completes them (no replacement characters)."""
    text, spans, pieces = "", [], []
    for index in range(len(completion_ids)):
        decoded = tokenizer.decode(completion_ids[: index + 1], skip_special_tokens=False)
        if decoded.endswith("\ufffd"):  # an incomplete character: it belongs to a later token
            decoded = text
        start = min(len(text), len(decoded))
        if not decoded.startswith(text):  # the decoder rewrote earlier text; keep spans monotone
            start = len(text)
            decoded = text + decoded[len(text):]
        spans.append((start, len(decoded)))
        pieces.append(decoded[start:])
        text = decoded
    return TokenPieces(text, pieces, spans)


def classify_tokens(
    pieces: TokenPieces,
    answer: str,
    privileged_text: str = "",
    student_prompt: str = "",
    extracted_answer: str | None = None,
    special_tokens: frozenset[str] = frozenset(),
    epistemic_words: frozenset[str] = EPISTEMIC_WORDS,
    copy_ngram: int = COPY_NGRAM,
    correct: bool | None = None,
) -> list[str]:
    """One class name (see `CLASSES`) per token. `extracted_answer` is the final answer the
    verifier found; `correct` its verdict (None: the answer is the reference when the two
    read the same)."""
    text = pieces.text
    copy_ranges = shared_ngram_ranges(text, privileged_text, student_prompt, copy_ngram)
    slot_ranges = []
    final_span = answer_occurrences(text, extracted_answer)[-1:] if extracted_answer else []
    if correct if correct is not None else extracted_answer and _same_answer(extracted_answer, answer):
        copy_ranges += final_span
    else:
        slot_ranges = final_span
    epistemic_ranges = [m.span() for m in _WORD.finditer(text) if m.group().lower() in epistemic_words]
    classes = []
    for (start, end), piece in zip(pieces.spans, pieces.pieces):
        if _overlaps(start, end, copy_ranges):
            classes.append("answer_copy")
        elif _overlaps(start, end, slot_ranges):
            classes.append("answer_slot")
        elif _overlaps(start, end, epistemic_ranges):
            classes.append("epistemic")
        elif piece in special_tokens or _STRUCTURAL_TOKEN.match(piece):
            classes.append("structural")
        else:
            classes.append("other")
    return classes


def answer_occurrences(text: str, answer: str) -> list[tuple[int, int]]:
    """Character ranges where `answer` appears as a whole (a number not inside a longer
    number, a word not inside a longer word); case-insensitive."""
    answer = answer.strip()
    if not answer:
        return []
    before = r"(?<![\w.])" if answer[0].isalnum() else ""
    after = r"(?![\w])" if answer[-1].isalnum() else ""
    pattern = re.compile(before + re.escape(answer) + after, re.IGNORECASE)
    return [m.span() for m in pattern.finditer(text)]


def shared_ngram_ranges(text: str, privileged_text: str, student_prompt: str = "", n: int = COPY_NGRAM) -> list[tuple[int, int]]:
    """Character ranges of `text` covered by word n-grams that also occur in the privileged
    text but not in the student's prompt (repeating the question is not copying)."""
    if not privileged_text or n < 1:
        return []
    privileged = _ngrams(_words(privileged_text), n) - _ngrams(_words(student_prompt), n)
    matches = list(_WORD.finditer(text))
    words = [m.group().lower() for m in matches]
    ranges = []
    for start in range(len(words) - n + 1):
        if tuple(words[start : start + n]) in privileged:
            ranges.append((matches[start].start(), matches[start + n - 1].end()))
    return ranges


def leaked_phrases(text: str, privileged_text: str = "", student_prompt: str = "", n: int = COPY_NGRAM) -> list[str]:
    """What in a student output refers to, or copies, context it never saw: phrases such as
    "the hint" / "the reference answer", and verbatim n-grams of the privileged-only text."""
    found = [m.group() for m in LEAK_PATTERN.finditer(text)]
    found += [text[start:end] for start, end in _merge(shared_ngram_ranges(text, privileged_text, student_prompt, n))]
    return found


def epistemic_count(text: str, epistemic_words: frozenset[str] = EPISTEMIC_WORDS) -> int:
    return sum(m.group().lower() in epistemic_words for m in _WORD.finditer(text))


def privileged_only_text(teacher_text: str, student_prompt: str, attempt: str | None = None) -> str:
    """What the teacher's prompt adds over the student's: its text with the student prompt
    and the student's own attempt (a feedback template quotes it) removed."""
    for known in (student_prompt, attempt):
        if known:
            teacher_text = teacher_text.replace(known.strip(), " ")
    return teacher_text


def _words(text: str) -> list[str]:
    return [m.group().lower() for m in _WORD.finditer(text)]


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _overlaps(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start < r_end and r_start < end for r_start, r_end in ranges)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _same_answer(a: str, b: str) -> bool:
    return " ".join(a.split()).lower() == " ".join(b.split()).lower()
