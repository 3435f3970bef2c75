"""Grade a short factual answer: does the completion name the attribute's value, and no other?

A question about a fact ("What is the capital of Velmoria?") is answered in a sentence ("The
capital of Velmoria is Drathen."), not in an answer line, so the number and answer-line
extraction of `check.verify` does not apply. Here a completion is correct when it names the
reference value (case-insensitive, as a whole word) and names none of its rivals: the other
values the same attribute takes anywhere in the task (or, for a number, any other number of
that many digits), so listing every capital is never right."""

from __future__ import annotations

import re
from typing import Sequence

from .result import VerifyResult, quote

METHOD = "attribute_value"


def verify_attribute(completion: str, answer: str, rivals: Sequence[str], attribute: str) -> VerifyResult:
    """Correct iff `completion` names `answer` and no rival value of `attribute`."""
    named = [value for value in dict.fromkeys([answer, *rivals]) if _names(completion, value)]
    if answer.strip().isdigit():
        digits = len(answer.strip())
        named += [n for n in re.findall(rf"(?<!\d)\d{{{digits}}}(?!\d)", completion) if n not in named]
    if not named:
        return VerifyResult(0.0, False, None, None, f"The response names no {attribute}.")
    correct = named == [answer]
    shown = ", ".join(quote(value) for value in named)
    if correct:
        return VerifyResult(1.0, True, answer, METHOD, f"The {attribute} you name, {quote(answer)}, is correct.")
    if len(named) > 1:
        return VerifyResult(0.0, False, shown, METHOD, f"The response names several values of {attribute} ({shown}).")
    return VerifyResult(0.0, False, shown, METHOD, f"The {attribute} you name, {shown}, is wrong.")


def _names(text: str, value: str) -> bool:
    """`value` occurs in `text` as a whole word (or words), case-insensitive."""
    return re.search(rf"(?<!\w){re.escape(value.strip())}(?!\w)", text, flags=re.IGNORECASE) is not None
