"""Refuse answers whose value is too big to compute, before anything tries to compute it.

`10^{10^{10}}` or `9^{9^{9^{9}}}` would make sympy work (and allocate) for hours. The worker
time limit in `timeout.py` is the guarantee; this check is the cheap first line that saves a
killed and restarted worker per pathological answer (a model that learns to spam towers
would otherwise cost a process start per sample).
"""

from __future__ import annotations

import math
import re

from .latex import matching_brace

MAX_ANSWER_CHARS = 1000  # a longer "final answer" is not an answer we can grade
MAX_DIGITS = 100_000  # 10^{100000} is fine (a quarter second); 10^{1000000} is not
_INF = float("inf")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_BASE_BEFORE = re.compile(r"(\d+(?:\.\d+)?)\s*$")


_POWER = re.compile(r"\s*(\*\*|\^)")


def _exponent_argument(s: str, start: int) -> tuple[str, int]:
    """The exponent of a `^`/`**` that starts at `start`: (its text, index after it).

    Chains are right-associative, as in Python and as models write them: the exponent of the
    first `^` in `9^9^9` or `9**9**9` is `9^9`.
    """
    i = start
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] in "+-":
        i += 1
    if i < len(s) and s[i] == "{":
        close = matching_brace(s, i)
        end = len(s) if close is None else close + 1
    else:
        m = _NUMBER.match(s, i)
        if not m:
            return s[start : i + 1], i + 1  # a symbol: not a literal number
        end = m.end()
    chained = _POWER.match(s, end)
    if chained:
        _, end = _exponent_argument(s, chained.end())
    return s[start:end], end


def log10_of_tower(expr: str) -> float | None:
    """log10 of |value| for `a`, `a^b`, `a^{b^{c}}`, `a**b**c`, `{a}^{-b}`: literal numbers only.

    Computed in logs, so a tower of any height costs nothing (`inf` when astronomically big);
    None for anything that is not such a tower. A negative exponent counts by its size, since
    10^{-10^{10}} is as costly to compute exactly as 10^{10^{10}}.
    """
    expr = expr.strip().lstrip("+-").lstrip()
    if expr.startswith("{"):
        close = matching_brace(expr, 0)
        if close is None:
            return None
        base_log = log10_of_tower(expr[1:close])
        rest = expr[close + 1 :].lstrip()
    else:
        m = _NUMBER.match(expr)
        if not m:
            return None
        base = float(m.group(0))
        base_log = math.log10(base) if base > 0 else -_INF
        rest = expr[m.end() :].lstrip()
    if base_log is None:
        return None
    if not rest:
        return base_log
    power = _POWER.match(rest)
    if not power:
        return None
    arg, end = _exponent_argument(rest, power.end())
    if rest[end:].strip():
        return None
    log_exponent = log10_of_tower(arg)
    if log_exponent is None:
        return None
    if base_log <= 0:
        return 0.0  # |base| <= 1: the power does not grow
    if log_exponent > 300 or base_log == _INF:
        return _INF
    return (10.0**log_exponent) * base_log


def _group_before(s: str, close: int) -> str | None:
    """Content of the ( ) or { } group that ends at index `close`."""
    opener = {")": "(", "}": "{"}[s[close]]
    depth = 0
    for i in range(close, -1, -1):
        if s[i] == s[close]:
            depth += 1
        elif s[i] == opener:
            depth -= 1
            if depth == 0:
                return s[i + 1 : close]
    return None


def _factorial_too_big(log10_n: float) -> bool:
    """Whether n! has more than MAX_DIGITS digits, for n given as log10(n)."""
    if log10_n > 12:
        return True
    n = 10.0**log10_n
    return math.lgamma(n + 1) / math.log(10) > MAX_DIGITS


def too_costly(answer: str) -> str | None:
    """Why `answer` is too costly to evaluate (a short reason), or None if it is fine."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    for m in re.finditer(r"\^|\*\*", answer):
        arg, _ = _exponent_argument(answer, m.end())
        log_exponent = log10_of_tower(arg)
        if log_exponent is None:
            continue
        exponent = 10.0 ** min(log_exponent, 300)
        base = _BASE_BEFORE.search(answer[: m.start()])
        if base is not None:
            b = float(base.group(1))
            if b <= 1:
                continue  # 0^anything and 1^anything are cheap
            digits = exponent * math.log10(b)
        else:
            digits = exponent  # a non-numeric base (x, e, (1+x)) is judged by its exponent
        if digits > MAX_DIGITS:
            return "a power too large to evaluate"
    for m in re.finditer(r"(\d+)\s*!|([)}])\s*!", answer):
        operand = m.group(1) if m.group(1) is not None else _group_before(answer, m.start(2))
        log_n = log10_of_tower(operand) if operand is not None else None
        if log_n is not None and _factorial_too_big(log_n):
            return "a factorial too large to evaluate"
    return None
