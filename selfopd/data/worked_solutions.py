"""Step-by-step solutions for the procedural arithmetic tasks, in the student's own answer
format, as privileged context for `teacher/worked_solution`.

A 135M model cannot work out a sum from an answer-only note, but it can follow a worked
column addition in context (the OPSD argument): the teacher then prefers the student's
correct digits for a reason the student can learn, not because it copies them. Each
solution works the columns from the ones up, with carries, and ends in the line the student
is trained to write ("So 47 + 38 = 85.").

    >>> print(arithmetic_solution("47 + 38"))
    Ones: 7 + 8 = 15, write 5, carry 1.
    Tens: 4 + 3 + 1 = 8, write 8.
    So 47 + 38 = 85.
"""

from __future__ import annotations

import re

PLACES = ("Ones", "Tens", "Hundreds", "Thousands", "Ten thousands", "Hundred thousands")
_SUM = re.compile(r"^\s*\d+(\s*\+\s*\d+)+\s*$")
_PRODUCT = re.compile(r"^\s*(\d+)\s*[*x×]\s*(\d+)\s*$")


def arithmetic_solution(expression: str) -> str | None:
    """The worked solution of a sum of non-negative integers (column addition) or a product
    of two (one partial product per digit of the second factor, then their sum); None for
    anything else (negative numbers, subtraction, division, parentheses)."""
    if _SUM.match(expression):
        terms = [int(term) for term in expression.split("+")]
        lines = column_addition(terms)
        return "\n".join([*lines, f"So {_spaced(expression)} = {sum(terms)}."])
    product = _PRODUCT.match(expression)
    if product:
        left, right = int(product.group(1)), int(product.group(2))
        return "\n".join([*long_multiplication(left, right), f"So {_spaced(expression)} = {left * right}."])
    return None


def column_addition(terms: list[int]) -> list[str]:
    """One line per column, ones first: the column's digits plus the carry, the digit written
    and the carry on; a final carry is written as the leading digit."""
    width = max(len(str(term)) for term in terms)
    lines, carry = [], 0
    for place in range(width):
        digits = [term // 10**place % 10 for term in terms if term >= 10**place or place == 0]
        total = sum(digits) + carry
        parts = " + ".join(str(d) for d in digits) + (f" + {carry}" if carry else "")
        carry, digit = divmod(total, 10)
        step = f"{_place(place)}: {parts} = {total}, write {digit}"
        lines.append(step + (f", carry {carry}." if carry else "."))
    if carry:
        lines.append(f"{_place(width)}: write the carry {carry}.")
    return lines


def long_multiplication(left: int, right: int) -> list[str]:
    """`left` times each digit of `right`, ones first, digit by digit with carries (one line
    per partial product, shifted by the digit's place), then the partial products added by
    columns. A one-digit `right` is the first line's working, one line per column."""
    if right < 10:
        return _times_digit_lines(left, right)
    lines, partials = [], []
    for place, digit in enumerate(int(d) for d in reversed(str(right))):
        partial = left * digit * 10**place
        shift = f", shifted {place} place{'s' if place > 1 else ''}: {partial}" if place else ""
        lines.append(f"{left} * {digit}: {'; '.join(_times_digit_steps(left, digit))} -> {left * digit}{shift}.")
        partials.append(partial)
    return [*lines, f"Add {' + '.join(str(p) for p in partials)}:", *column_addition(partials)]


def _times_digit_steps(left: int, digit: int) -> list[str]:
    """The columns of `left` times one digit, ones first: "7 * 8 = 56, write 6, carry 5"."""
    steps, carry = [], 0
    text = str(left)
    for char in reversed(text):
        total = int(char) * digit + carry
        parts = f"{char} * {digit}" + (f" + {carry}" if carry else "")
        carry, written = divmod(total, 10)
        steps.append(f"{parts} = {total}, write {written}" + (f", carry {carry}" if carry else ""))
    if carry:
        steps.append(f"write the carry {carry}")
    return steps


def _times_digit_lines(left: int, digit: int) -> list[str]:
    """The same steps one line per column, named by place."""
    steps = _times_digit_steps(left, digit)
    return [f"{_place(place)}: {step}." for place, step in enumerate(steps)]


def _place(index: int) -> str:
    return PLACES[index] if index < len(PLACES) else f"Place {index + 1}"


def _spaced(expression: str) -> str:
    """The expression as the question writes it, single spaces around the operator."""
    return re.sub(r"\s*([+*x×])\s*", r" \1 ", expression.strip())
