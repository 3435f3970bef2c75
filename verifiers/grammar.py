"""Safe answer grammars: what a scorer that runs Python on an answer may be handed.

Some reasoning-gym scorers read the model's answer with sympy's `parse_expr` or Python's
`eval`, and both run Python: `__import__('os').system(...)` as an answer ran a command. Such a
scorer sees an answer only when it reads in its task's grammar (`task_grammars.py`). Text is
split into tokens (ASCII only: Python folds look-alike letters such as fullwidth `ｅｖａｌ` into
names), then the tokens are checked:

- `Expression`: numbers, `+ - * / ** ^`, parentheses, `=` and `,` at the top, and names from
  an allow-list; only an allowed function may be called. Parsed with Python's own precedence,
  so nothing but arithmetic on those names can be read into it: no attribute, no subscript,
  no string, no keyword. Every number it would compute is bounded in size (names count as 1),
  so `2**99999999`, `9**9**9` or `2**(x*0 + 9**9)` are refused before any scorer works on them.
- `Literal`: Python list literals for scorers that `eval` one (numbers, plain quoted strings,
  `[ ] ( ) ,`, a leading minus, allowed bare words). An opening bracket never follows a value,
  so nothing can be called or indexed.
- `Integer`: one signed integer literal (decimal, 0x, 0b, 0o).

`reject_reason(text, grammar)` says why text is refused, or None when it reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .prescreen import MAX_DIGITS

MAX_CHARS = 10_000  # our own reading is linear; what a scorer then does is the time limit's business
MAX_DEPTH = 40  # nesting of brackets and calls
MAX_SYMBOLIC_EXPONENT = 1000  # (x + 1)**100000 is no answer to any task, and slow to simplify
_INF = float("inf")
_TOKEN = re.compile(
    r"(?P<space>[ \t\r\n]+)"
    r"|(?P<number>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<string>'[A-Za-z0-9 ._+-]*'|\"[A-Za-z0-9 ._+-]*\")"
    r"|(?P<op>\*\*|[-+*/^=,()\[\]])"
)
_INTEGER = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|0[bB][01]+|0[oO][0-7]+|[0-9]+)")
_NEVER = re.compile(r"(?!)")


class Rejected(ValueError):
    """The text is not in the grammar; the message says what was refused."""


@dataclass(frozen=True)
class Token:
    kind: str  # number, name, string, op
    text: str
    start: int


@dataclass(frozen=True)
class Expression:
    names: frozenset[str] = frozenset()  # variables and constants
    functions: frozenset[str] = frozenset()  # names that may be called


@dataclass(frozen=True)
class Literal:
    words: re.Pattern[str] = field(default=_NEVER)  # bare words allowed (fullmatch)


@dataclass(frozen=True)
class Integer:
    pass


Grammar = Expression | Literal | Integer


def tokenize(text: str) -> list[Token]:
    """The tokens of `text`, whitespace dropped; Rejected at the first character that starts none."""
    tokens, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise Rejected(f"character {text[i]!r} at {i}")
        if m.lastgroup != "space":
            tokens.append(Token(m.lastgroup or "", m.group(), i))
        i = m.end()
    return tokens


def reject_reason(text: str, grammar: Grammar) -> str | None:
    """Why `text` is not in `grammar` (a short phrase), or None when it reads."""
    if len(text) > MAX_CHARS:
        return f"longer than {MAX_CHARS} characters"
    try:
        if isinstance(grammar, Integer):
            if not _INTEGER.fullmatch(text.strip(), 0):
                raise Rejected("not an integer literal")
        elif isinstance(grammar, Literal):
            _check_literal(tokenize(text), grammar)
        else:
            _ExpressionParser(tokenize(text), grammar).answer()
    except Rejected as e:
        return str(e)
    return None


# --- literals ------------------------------------------------------------------------------
_OPENERS = {"(": ")", "[": "]"}


def _check_literal(tokens: list[Token], grammar: Literal) -> None:
    stack: list[str] = []
    previous: Token | None = None
    for t, nxt in zip(tokens, tokens[1:] + [None]):
        value_before = previous is not None and (previous.kind != "op" or previous.text in ")]")
        if t.kind == "name" and not grammar.words.fullmatch(t.text):
            raise Rejected(f"name {t.text!r}")
        if t.kind == "string" and previous is not None and previous.kind != "op" \
                and previous.start + len(previous.text) == t.start:
            raise Rejected(f"a prefixed string at {t.start}")
        if t.kind == "op":
            if t.text in _OPENERS:
                if value_before:
                    raise Rejected(f"a call or index at {t.start}")
                stack.append(_OPENERS[t.text])
                if len(stack) > MAX_DEPTH:
                    raise Rejected(f"nesting deeper than {MAX_DEPTH}")
            elif t.text in ")]":
                if not stack or stack.pop() != t.text:
                    raise Rejected(f"unbalanced {t.text!r} at {t.start}")
            elif t.text == "-":
                if nxt is None or nxt.kind != "number":
                    raise Rejected(f"'-' not before a number at {t.start}")
            elif t.text != ",":
                raise Rejected(f"operator {t.text!r}")
        previous = t
    if stack:
        raise Rejected("unclosed bracket")


# --- expressions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Size:
    """Upper bounds for a subexpression: decimal digits of its exact value (numerator and
    denominator together) and max(|value|, 1), every name counted as 1. Both only grow with
    each operand, so any grouping of the same tokens is bounded too."""

    digits: float
    magnitude: float
    symbolic: bool


def _finite_or_inf(x: float) -> float:
    return _INF if x != x else x  # NaN (0 * inf) must not slip past a comparison


def _power(base: float, exponent: float) -> float:
    try:
        return _finite_or_inf(base**exponent)
    except OverflowError:
        return _INF


class _ExpressionParser:
    """Recursive descent in Python's precedence: `=` and `,` < `^` < `+ -` < `* /` < unary < `**`."""

    def __init__(self, tokens: list[Token], grammar: Expression) -> None:
        self.tokens, self.grammar, self.i, self.depth = tokens, grammar, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.i].text if self.i < len(self.tokens) else None

    def take(self) -> Token:
        if self.i >= len(self.tokens):
            raise Rejected("unexpected end")
        self.i += 1
        return self.tokens[self.i - 1]

    def answer(self) -> None:
        if not self.tokens:
            raise Rejected("empty")
        self.xor()
        while self.peek() in ("=", ","):
            self.take()
            self.xor()
        if self.i < len(self.tokens):
            t = self.tokens[self.i]
            raise Rejected(f"unexpected {t.text!r} at {t.start}")

    def xor(self) -> _Size:
        """`^` is XOR to plain `parse_expr` and `eval`, a power under sympy's `convert_xor`:
        bounded as a power (right-associative, like a power tower), whichever the scorer reads."""
        size = self.sum()
        if self.peek() != "^":
            return size
        self.take()
        self.enter()
        exponent = self.xor()
        self.depth -= 1
        return self.raised(size, exponent)

    def sum(self) -> _Size:
        size = self.product()
        while self.peek() in ("+", "-"):
            self.take()
            other = self.product()
            size = self.checked(size.digits + other.digits + 1, size.magnitude + other.magnitude,
                                size.symbolic or other.symbolic)
        return size

    def product(self) -> _Size:
        size = self.unary()
        while self.peek() in ("*", "/"):
            divide = self.take().text == "/"
            other = self.unary()
            scale = _power(10.0, other.digits) if divide else other.magnitude
            size = self.checked(size.digits + other.digits, size.magnitude * scale, size.symbolic or other.symbolic)
        return size

    def unary(self) -> _Size:
        if self.peek() in ("+", "-"):
            self.take()
            self.enter()
            size = self.unary()
            self.depth -= 1
            return size
        return self.power()

    def power(self) -> _Size:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        self.enter()
        exponent = self.unary()  # right-associative, as in Python: 9**9**9 is 9**(9**9)
        self.depth -= 1
        return self.raised(base, exponent)

    def raised(self, base: _Size, exponent: _Size) -> _Size:
        e = max(exponent.magnitude, 1.0)
        if base.symbolic and e > MAX_SYMBOLIC_EXPONENT:
            raise Rejected(f"an exponent above {MAX_SYMBOLIC_EXPONENT}")
        return self.checked(base.digits * e + exponent.digits, _power(max(base.magnitude, 1.0), e),
                            base.symbolic or exponent.symbolic)

    def atom(self) -> _Size:
        t = self.take()
        if t.kind == "number":
            mantissa, _, exp = t.text.lower().partition("e")
            if len(exp.lstrip("+-")) > 6:
                raise Rejected("a number too large to evaluate")
            digits = sum(c.isdigit() for c in mantissa) + abs(int(exp or 0))
            return self.checked(digits, max(_finite_or_inf(float(t.text)), 1.0), False)
        if t.kind == "name":
            if self.peek() == "(":
                return self.call(t)
            if t.text not in self.grammar.names:
                raise Rejected(f"name {t.text!r}")
            return _Size(1, 1.0, True)
        if t.text == "(":
            self.enter()
            size = self.xor()
            self.close(t)
            return size
        raise Rejected(f"unexpected {t.text!r} at {t.start}")

    def call(self, name: Token) -> _Size:
        if name.text not in self.grammar.functions:
            raise Rejected(f"call of {name.text!r}")
        opener = self.take()
        self.enter()
        args = [self.xor()]
        while self.peek() == ",":
            self.take()
            args.append(self.xor())
        self.close(opener)
        biggest = max(a.magnitude for a in args)
        # exp(x) is the fastest-growing function allowed: a bound for all of them
        return self.checked(max(a.digits for a in args) + 1, _INF if biggest > 700 else math.exp(biggest), True)

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Rejected(f"nesting deeper than {MAX_DEPTH}")

    def close(self, opener: Token) -> None:
        if self.peek() != ")":
            raise Rejected(f"unclosed {opener.text!r} at {opener.start}")
        self.take()
        self.depth -= 1

    @staticmethod
    def checked(digits: float, magnitude: float, symbolic: bool) -> _Size:
        if _finite_or_inf(digits) > MAX_DIGITS:
            raise Rejected("a number too large to evaluate")
        return _Size(digits, _finite_or_inf(magnitude), symbolic)
