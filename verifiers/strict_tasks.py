"""Stricter checks for tasks whose reasoning-gym scorer checks less than its puzzle states.

An RL policy learns what a scorer pays for, not what the question asks, and these scorers pay for
answers that do not solve the item (reasoning-gym 0.1.25):
- puzzle24 counts four numbers in range instead of comparing them with the puzzle's, and truncates the
  value with int(): `(2+2)*(3+3)` and `9+9+6.9` score 1 on every puzzle;
- countdown finds the numbers used with the regex `\\b\\d+\\b`, which `0e0` and `159e0` slip past, and
  compares the value with np.isclose (relative 1e-5: 100000.33 is 100000):
  `(39+19+12+69+58)*0e0+159e0` scores 1;
- game_of_life_halting compares bool(answer) with bool(reference): every non-empty answer scores 1;
- coin_flip pays (matching prefix) / (shorter length): "0" and "0.1" score 1 for 0.109375, and its absolute
  tolerance pays "0" for 6.103515625e-05.
Each answer to these tasks is first checked by the puzzle's rules: one that breaks them scores 0 and no
scorer sees it; one that keeps them still goes to reasoning-gym's scorer, so selfopd never pays more
than reasoning-gym would. Arithmetic is read by the small parser below (whole numbers, + - * / and
parentheses, after `grammar.tokenize`) and computed exactly with Fractions: never `eval`, never sympy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from .grammar import MAX_DEPTH, Rejected, Token, tokenize
from .task_grammars import metadata_of, source_task

PUZZLE24_TARGET = 24
MAX_NUMBER_DIGITS = 18  # longer than any item's number (and past 4300 digits int() refuses to read)
COIN_FLIP_TOLERANCE = Fraction(1, 10**4)  # the scorer's own (absolute) tolerance for a number that is the probability
COIN_FLIP_RELATIVE = Fraction(1, 10**3)  # and 0.1% of it: "0" is within 1e-4 of 6.1e-05, and no answer to it
_ARITHMETIC = {"+", "-", "*", "/", "(", ")"}
# A decimal (its references write 6.103515625e-05: a short exponent) or a fraction such as 7/64.
_PROBABILITY = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3}|/[0-9]+)?")


class _Exact:
    """Recursive descent over + - * / and parentheses, in Python's precedence, with exact Fractions."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens, self.i, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.i].text if self.i < len(self.tokens) else None

    def take(self) -> Token:
        if self.i >= len(self.tokens):
            raise Rejected("ends too soon")
        self.i += 1
        return self.tokens[self.i - 1]

    def value(self) -> Fraction:
        value = self.sum()
        if self.i < len(self.tokens):
            raise Rejected(f"has {self.tokens[self.i].text!r} at {self.tokens[self.i].start} too many")
        return value

    def sum(self) -> Fraction:
        value = self.product()
        while self.peek() in ("+", "-"):
            add, other = self.take().text == "+", self.product()
            value = value + other if add else value - other
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            multiply, other = self.take().text == "*", self.unary()
            if not multiply and other == 0:
                raise Rejected("divides by zero")
            value = value * other if multiply else value / other
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            negate = self.take().text == "-"
            value = self.nested(self.unary)
            return -value if negate else value
        token = self.take()
        if token.kind == "number":
            return Fraction(int(token.text))
        if token.text != "(":
            raise Rejected(f"has {token.text!r} at {token.start} where a number belongs")
        value = self.nested(self.sum)
        if self.take().text != ")":
            raise Rejected(f"leaves the '(' at {token.start} open")
        return value

    def nested(self, parse: Callable[[], Fraction]) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Rejected(f"nests deeper than {MAX_DEPTH}")
        value = parse()
        self.depth -= 1
        return value


def _listed(numbers: list[int]) -> str:
    return ", ".join(map(str, sorted(numbers)))


def _makes(answer: str, numbers: list[int], target: Any) -> str | None:
    """Why `answer` is not an expression that uses exactly `numbers`, each once, with value `target`."""
    try:
        tokens = tokenize(answer)
        for token in tokens:
            if token.kind == "number" and not token.text.isdigit():
                return f"{token.text!r} is not a whole number"
            if token.kind == "number" and len(token.text) > MAX_NUMBER_DIGITS:
                return f"a number of {len(token.text)} digits is none of the item's"
            if token.kind != "number" and token.text not in _ARITHMETIC:
                return f"{token.text!r} is not a number, + - * / or a parenthesis"
        used = [int(token.text) for token in tokens if token.kind == "number"]
        if sorted(used) != sorted(numbers):  # checked first: what is computed below is then the item's size
            return f"uses {_listed(used) or 'no number'}, not {_listed(numbers)} each once"
        value = _Exact(tokens).value()
    except Rejected as e:
        return str(e)
    return None if value == target else f"is {value}, not {target}"


def _puzzle24(answer: str, entry: Mapping[str, Any]) -> str | None:
    return _makes(answer, list(metadata_of(entry).get("numbers", ())), PUZZLE24_TARGET)


def _countdown(answer: str, entry: Mapping[str, Any]) -> str | None:
    metadata = metadata_of(entry)
    return _makes(answer, list(metadata.get("numbers", ())), metadata.get("target"))


def _halting(answer: str, entry: Mapping[str, Any]) -> str | None:
    said = answer.strip().lower()
    if said not in ("true", "false"):
        return "is not True or False"
    return None if said == str(entry.get("answer")).strip().lower() else "is not the item's verdict"


def _probability(answer: str, entry: Mapping[str, Any]) -> str | None:
    text = answer.replace(",", "").strip()
    if len(text) > 100 or not _PROBABILITY.fullmatch(text):
        return "is not a decimal or a fraction"
    try:
        probability = Fraction(str(entry.get("answer")).replace(",", "").strip())
        off = abs(Fraction(text) - probability)
    except (ValueError, ZeroDivisionError):
        return "cannot be compared with the item's probability"
    close = off <= COIN_FLIP_TOLERANCE and off <= COIN_FLIP_RELATIVE * abs(probability)
    return None if close else f"is {float(off):.3g} off the item's probability"


STRICT: dict[str, Callable[[str, Mapping[str, Any]], str | None]] = {
    "puzzle24": _puzzle24,
    "countdown": _countdown,
    "game_of_life_halting": _halting,
    "coin_flip": _probability,
}


def strict_reason(task: str, answer: str, entry: Mapping[str, Any]) -> str | None:
    """Why `answer` breaks the rules of `entry`'s puzzle (a short phrase), or None when it keeps them or
    the task has no stricter check. Metadata is read as `references.screen_entry` has checked it."""
    rule = STRICT.get(source_task(task, entry))
    return None if rule is None else rule(answer, entry)
