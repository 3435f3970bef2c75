"""Exact values of plain numbers, so most answers are compared without sympy or a worker.

A percent is read both ways: `50%` stands for 50 and for 0.5, so it matches a reference of
`50`, `50%` or `0.5` (graders disagree on which one a question means; both are the same
quantity). Without a percent sign `50` and `0.5` stay different.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .prescreen import MAX_ANSWER_CHARS

_ASSIGNMENT = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")  # "x = 3" -> "3"
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?")
_SLASH = re.compile(r"([+-]?)(\d+)\s*/\s*(\d+)")
_FRAC = re.compile(r"([+-]?)\\frac(?:\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}|(\d)(\d))")
_MAX_EXPONENT = 1000  # 1e1000 is fine for Fraction; 1e9999 would already be silly


@dataclass(frozen=True)
class PlainNumber:
    """Readings of a plain number (two for a percent), and whether it was written as a/b."""

    values: frozenset[Fraction]
    is_fraction: bool


def _parse_value(s: str) -> tuple[Fraction, bool] | None:
    """(value, written as a fraction) for `3`, `-2.5`, `1e3`, `3/4`, `\\frac{3}{4}`, `\\frac34`."""
    if len(s) > MAX_ANSWER_CHARS:  # int() refuses 4300+ digits; the pre-screen refuses these
        return None
    if _DECIMAL.fullmatch(s):
        exponent = re.search(r"[eE]([+-]?\d+)$", s)
        if exponent and abs(int(exponent.group(1))) > _MAX_EXPONENT:
            return None
        return Fraction(s), False
    m = _SLASH.fullmatch(s)
    if m:
        sign, num, den = m.groups()
        return (None if int(den) == 0 else (Fraction(int(num), int(den)) * (-1 if sign == "-" else 1), True))
    m = _FRAC.fullmatch(s)
    if m:
        sign = -1 if m.group(1) == "-" else 1
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        return None if int(den) == 0 else (sign * Fraction(int(num), int(den)), True)
    return None


def parse_plain_number(normalized: str) -> PlainNumber | None:
    """The number a normalised answer states, or None if it is anything else."""
    s = _ASSIGNMENT.sub("", normalized, count=1) if _ASSIGNMENT.match(normalized) else normalized
    s = re.sub(r"^([+-])\s+", r"\1", s.strip())
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    parsed = _parse_value(s)
    if parsed is None:
        return None
    value, is_fraction = parsed
    values = {value, value / 100} if percent else {value}
    return PlainNumber(values=frozenset(values), is_fraction=is_fraction)
