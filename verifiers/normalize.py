"""Canonical text form of a final answer, before any comparison.

Only rewrites that cannot change the value: delimiters and spacing commands go, `\\dfrac`
becomes `\\frac`, `\\text{}` is unwrapped, thousands separators and degree signs are dropped,
`\\%` becomes `%` (the percent itself is interpreted later, in `numeric.py`), and trailing
unit words are dropped only after a plain number ("5 apples", "12 cm^2"), never after an
expression, and never when the word is math ("2 pi").
"""

from __future__ import annotations

import re

from .latex import command_arguments, unwrap_commands

_UNICODE = {
    "\u2212": "-",  # minus sign
    "\u2013": "-",  # en dash, often a minus in model output
    "\u00d7": "\\times ",
    "\u22c5": "\\cdot ",
    "\u00f7": "\\div ",
    "\u221a": "\\sqrt",
    "\u03c0": "\\pi ",
    "\u221e": "\\infty ",
    "\u00b0": "",  # degree sign
    "\u00a0": " ",
    "\u2009": " ",
    "\u202f": " ",
}
_TEXT_COMMANDS = ("text", "textbf", "textit", "textrm", "texttt", "mathrm", "mathbf", "mathit", "mbox", "hbox")
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad(?![A-Za-z])|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![A-Za-z])\.?")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])")
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?")
# Words that are math, not units: "2 pi" must stay 2*pi.
_MATH_WORDS = {"pi", "e", "i", "inf", "infinity", "sqrt", "log", "ln", "sin", "cos", "tan", "exp", "and", "or"}
_UNITS_AFTER_NUMBER = re.compile(
    rf"(?P<num>{_NUMBER}%?)\s*(?P<words>[A-Za-z]{{2,}}(?:[ \-/][A-Za-z]{{1,}}){{0,3}})\.?\s*(?:\^\s*\{{?\d\}}?)?"
)
_CHOICE = re.compile(r"\(\s*([A-Za-z])\s*\)")


def strip_math_delimiters(s: str) -> str:
    """Drop `$`, `\\( \\)`, `\\[ \\]` and currency `\\$`: none of them is part of the value."""
    s = s.replace("\\$", "")
    s = re.sub(r"^\s*\\[(\[]", "", s)  # leading \( or \[
    s = re.sub(r"\\[)\]]\s*$", "", s)  # trailing \) or \]
    return s.replace("$", "")


def strip_units(s: str) -> str:
    """`5 apples` -> `5`, `12 cm^2` -> `12`; leaves `2 pi`, `x cm` and `3 and 4` alone."""
    m = _UNITS_AFTER_NUMBER.fullmatch(s)
    if not m:
        return s
    words = re.split(r"[ \-/]", m.group("words").lower())
    if any(w in _MATH_WORDS for w in words):
        return s
    return m.group("num")


def normalize_answer(text: str) -> str:
    """The canonical form compared by `answers_equivalent` (see the module docstring)."""
    s = text.strip()
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = strip_math_delimiters(s).strip()
    # A whole-answer box, e.g. a reference written as \boxed{...}.
    boxes = command_arguments(s, ("boxed", "fbox"))
    if len(boxes) == 1 and boxes[0][0] == 0 and boxes[0][2] == len(s) - 1:
        s = s[boxes[0][1] + 1 : -1].strip()
    s = unwrap_commands(s, _TEXT_COMMANDS)
    s = _LEFT_RIGHT.sub("", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = s.replace("\\displaystyle", "")
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "%")
    s = s.replace("{,}", "")  # 1{,}234 is LaTeX for a thousands comma
    s = _SPACING.sub(lambda m: "" if m.group(0) in ("\\!", "\\,") else " ", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = s.strip("*_`").strip()  # markdown emphasis around a whole answer
    s = s.rstrip(".").strip()
    s = strip_units(s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _CHOICE.fullmatch(s)
    if m:  # multiple choice "(B)" -> "B"
        s = m.group(1)
    return s
