"""Find the final answer in a model completion, and say which rule found it.

Rules, most explicit first (the first rule that finds something wins):
  boxed        last complete `\\boxed{...}` / `\\fbox{...}` (nested braces allowed;
               an unbalanced or empty box is ignored, so a generation cut off inside
               `\\boxed{` falls through to the other rules instead of crashing)
  answer_tag   last `<answer>...</answer>` (the reasoning-gym format)
  answer_line  last "Answer: ..." / "Final answer: ..." / "the answer is ..." (any case)
  gsm8k        last `#### ...` line
  last_number  last number in the text (integer, decimal, negative, 1,234, or a/b)

Whatever rule found it, an answer written as a worked equation of numbers ("3 + 4 = 7",
"2 * 3 = 6 = 6") is its right-hand side: the student stated 7, not the sum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .latex import command_arguments
from .prescreen import MAX_ANSWER_CHARS

METHODS = ("boxed", "answer_tag", "answer_line", "gsm8k", "last_number")


@dataclass(frozen=True)
class Extraction:
    """An answer found in a completion: its text as written (trimmed) and the rule that found it."""

    text: str
    method: str


def extract_boxed(text: str) -> str | None:
    """Content of the last complete, non-empty `\\boxed{}` or `\\fbox{}`."""
    for _, open_i, close in reversed(command_arguments(text, ("boxed", "fbox"))):
        content = text[open_i + 1 : close].strip()
        if content:
            return content
    return None


def extract_answer_tag(text: str) -> str | None:
    """Content of the last non-empty `<answer>...</answer>` (searched from the end: linear time)."""
    lower = text.lower()
    close = len(text)
    while True:
        close = lower.rfind("</answer>", 0, close)
        if close < 0:
            return None
        start = lower.rfind("<answer>", 0, close)
        if start < 0:
            return None
        content = text[start + len("<answer>") : close].strip()
        if content:
            return content


# "Answer: 42", "**Final Answer:** 42", "The final answer is 42." (the rest of that line).
_ANSWER_MARKER = re.compile(
    r"\b(?:final\s+)?answer[ \t]*(?:\*\*|__)?[ \t]*(?::|\bis\b:?)[ \t]*(?:\*\*|__)?[ \t]*",
    re.IGNORECASE,
)
# "The total is 42 dollars" -> "42 dollars": a few words of prose before a verb.
_LEADING_PROSE = re.compile(r"^(?:[A-Za-z']+\s+){0,5}?(?:is|are|was|equals|=)\s+(?=\S)", re.IGNORECASE)
# A sentence end: ". " followed by more prose. "3.5" and "e.g." are left alone.
_SENTENCE_END = re.compile(r"(?<=[^\s.])\.\s+(?=[A-Z(])")


def _clean_line_answer(ans: str) -> str:
    """Trim what follows an answer marker down to the answer itself."""
    ans = _SENTENCE_END.split(ans, maxsplit=1)[0]
    ans = ans.strip().strip("*_` ").strip()
    ans = ans.rstrip(".").strip()
    if "$" not in ans and "\\" not in ans:
        ans = _LEADING_PROSE.sub("", ans, count=1)
    return ans


def _looks_like_an_answer(ans: str) -> bool:
    """After "the answer is", prose ("not obvious") is not an answer; a number or a word is."""
    return bool(re.search(r"[\d$\\]", ans)) or len(ans.split()) == 1


# How much of the line after a marker is read: more than the pre-screen lets through
# (MAX_ANSWER_CHARS), and a bound, so a runaway "the answer is the answer is ..." line
# costs linear time, not quadratic.
_MAX_LINE_CHARS = 2 * MAX_ANSWER_CHARS


def extract_answer_line(text: str) -> str | None:
    """The answer after the last "answer:" / "answer is" marker that has one."""
    for m in reversed(list(_ANSWER_MARKER.finditer(text))):
        end = text.find("\n", m.end(), m.end() + _MAX_LINE_CHARS)
        ans = _clean_line_answer(text[m.end() : end if end >= 0 else m.end() + _MAX_LINE_CHARS])
        explicit = ":" in m.group(0)
        if ans and (explicit or _looks_like_an_answer(ans)):
            return ans
    return None


_GSM8K = re.compile(r"####[ \t]*([^\n]*)")


def extract_gsm8k(text: str) -> str | None:
    """The text after the last `####` that has some."""
    for m in reversed(list(_GSM8K.finditer(text))):
        ans = m.group(1).strip().rstrip(".").strip()
        if ans:
            return ans
    return None


# A number not glued to a word before it ("x2", "3.5.1" tails are skipped); units after
# it are fine ("10km"). Thousands groups must be exact (1,234 but not 1,2345); a/b is kept
# whole; "5-3" gives 5 and 3, "= -3" gives -3.
_NUMBER = re.compile(
    r"(?<![\w./])-?(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?(?:/\d+)?(?![\d/])"
    r"|(?<![\w.])-?\.\d+"
)


def extract_last_number(text: str) -> str | None:
    """The last number in the text, as written (commas kept, unicode minus made ASCII)."""
    matches = _NUMBER.findall(text.replace("\u2212", "-"))
    return matches[-1] if matches else None


# Numbers, arithmetic operators and "=" only, ending in "= <result>".
_WORKED_EQUATION = re.compile(r"^[\d\s.,+\-*/×÷·()^=]*=\s*(?P<result>[^=]*[^=\s])\s*$")


def equation_result(answer: str) -> str:
    """The result of a worked arithmetic equation ("3 + 4 = 7" -> "7"); other text unchanged.

    Only when everything left of the last "=" is numbers and operators: "x = 3" and
    "a = 1, b = 2" stay as written (the equivalence check reads those)."""
    match = _WORKED_EQUATION.match(answer)
    if match and re.search(r"\d", answer[: match.start("result")]):
        return match.group("result").strip()
    return answer


_RULES = (
    ("boxed", extract_boxed),
    ("answer_tag", extract_answer_tag),
    ("answer_line", extract_answer_line),
    ("gsm8k", extract_gsm8k),
    ("last_number", extract_last_number),
)


def extract_answer(text: str, *, methods: tuple[str, ...] = METHODS) -> Extraction | None:
    """The final answer in `text`, from the first rule in METHODS order that finds one.

    `methods` restricts which rules may run, e.g. ("boxed",) to reward only boxed answers.
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown extraction methods {sorted(unknown)}; known: {METHODS}")
    for name, rule in _RULES:
        if name in methods:
            found = rule(text)
            if found:
                return Extraction(text=equation_result(found), method=name)
    return None
