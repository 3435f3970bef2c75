"""The answer grammars on their own: what reads, what is refused and why, and that reading any
text is fast and never raises (it runs in the caller's process, with no time limit)."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from selfopd.verifiers.grammar import MAX_CHARS, Expression, Integer, Literal, reject_reason, tokenize
from tests.fuzz_settings import examples

POLYNOMIAL = Expression(names=frozenset({"x"}))
INTEGRAL = Expression(names=frozenset({"x", "C", "pi", "E"}), functions=frozenset({"sin", "exp", "sqrt", "log"}))
BOARD = Literal(words=re.compile(r"Q|_"))


@pytest.mark.parametrize("text, grammar", [
    ("94*4 - 61 - 6", Expression()), ("42*(30 - 4 - 23)", Expression()), ("9*3*8/9", Expression()),
    ("-896*x**3 + 2240*x**2 + 3584*x", POLYNOMIAL), ("x**-2", POLYNOMIAL), ("-x**2", POLYNOMIAL),
    ("2.5e3*x - .5", POLYNOMIAL), ("x = 3", POLYNOMIAL), ("x^2", POLYNOMIAL), ("(x + 1)**1000", POLYNOMIAL),
    ("-4*(-2*x - 8)**(3/2)/3 + C", INTEGRAL), ("-2*x**3*sin(x) + exp(2*x)*log(x, 2) + C", INTEGRAL),
    ("sqrt(x) + pi*E", INTEGRAL), ("2**100", Expression()), ("10**9999", Expression()),
    ("1 0 1\n0 1 0", Literal()), ("[[1, 0], [0, 1]]", Literal()), ("['52.2', \"-30.0\"]", Literal()),
    ("(1, -2.5)", Literal()), ("_ Q _\nQ _ _", BOARD), ("[['_', 'Q'], ['Q', '_']]", BOARD),
    ("0x5b993", Integer()), ("-0X3D2d", Integer()), (" 12 ", Integer()), ("0b101", Integer()),
])
def test_answers_of_the_grammar_read(text, grammar):
    assert reject_reason(text, grammar) is None


@pytest.mark.parametrize("text, grammar, reason", [
    # code: attribute walks, dunder names, calls, lambdas, keywords, strings, subscripts
    ("().__class__.__bases__[0].__subclasses__()", POLYNOMIAL, "character '.'"),
    ("__import__('os').system('true')", INTEGRAL, "character '.'"),
    ("__import__('os')", INTEGRAL, "call of '__import__'"),
    ("sympify.__globals__", INTEGRAL, "character '.'"),
    ("lambda: x", POLYNOMIAL, "character ':'"),
    ("lambda x: x", POLYNOMIAL, "character ':'"),
    ("x if x else x", POLYNOMIAL, "unexpected 'if'"),
    ("getattr(x, 'y')", INTEGRAL, "call of 'getattr'"),
    ("chr(95)*2", INTEGRAL, "call of 'chr'"),
    ("x(1)", POLYNOMIAL, "call of 'x'"),
    ("(x)(1)", POLYNOMIAL, "unexpected '('"),
    ("x[0]", POLYNOMIAL, "unexpected '['"),
    ("'x'", POLYNOMIAL, "unexpected \"'x'\""),
    ("y", POLYNOMIAL, "name 'y'"),
    ("Integral(x, x)", INTEGRAL, "call of 'Integral'"),
    ("sin", INTEGRAL, "name 'sin'"),
    ("\uff45\uff58\uff50(x)", INTEGRAL, "character"),  # fullwidth: Python reads it as exp
    ("x\u200b", POLYNOMIAL, "character"),
    ("x % 2", POLYNOMIAL, "character '%'"),
    ("x // 2", POLYNOMIAL, "unexpected '/'"),
    ("2x", POLYNOMIAL, "unexpected 'x'"),
    ("1_000", Expression(), "unexpected '_000'"),
    ("", Expression(), "empty"),
    ("(x", POLYNOMIAL, "unclosed '('"),
    # sizes: huge exponents and towers, however they are written
    ("2**99999999", Expression(), "too large"),
    ("9**9**9", Expression(), "too large"),
    ("9^9^9", Expression(), "too large"),
    ("2^9**9*0.00001", Expression(), "too large"),
    ("2**(x*0 + 9**9)", POLYNOMIAL, "too large"),
    ("2**sqrt(10**200)", INTEGRAL, "too large"),
    ("x**1001", POLYNOMIAL, "an exponent above 1000"),
    ("(x + 1)**100000", POLYNOMIAL, "an exponent above 1000"),
    ("1e9999999", Expression(), "too large"),
    ("10**" + "9" * 5000, Expression(), "too large"),
    ("-" * 50 + "x", POLYNOMIAL, "nesting deeper"),
    ("(" * 50 + "x" + ")" * 50, POLYNOMIAL, "nesting deeper"),
    ("x+" * MAX_CHARS + "x", POLYNOMIAL, "longer than"),
    # literals for eval: no call, no index, no name, no operator, no string prefix
    ("[1][0]", Literal(), "a call or index"),
    ("(1)(2)", Literal(), "a call or index"),
    ("'a' [0]", Literal(), "a call or index"),
    ("x", Literal(), "name 'x'"),
    ("__import__", BOARD, "name '__import__'"),
    ("Q _ Q_", BOARD, "name 'Q_'"),
    ("Q'abc'", BOARD, "a prefixed string"),
    ("1 + 1", Literal(), "operator '+'"),
    ("-x", BOARD, "'-' not before a number"),
    ("'a\\x5f'", Literal(), "character"),
    ("'{x}'", Literal(), "character"),
    ("[1, 2", Literal(), "unclosed bracket"),
    ("[1)", Literal(), "unbalanced"),
    ("[" * 41 + "]" * 41, Literal(), "nesting deeper"),
    ("0x1g", Integer(), "not an integer"),
    ("1+1", Integer(), "not an integer"),
    ("int('1')", Integer(), "not an integer"),
])
def test_everything_else_is_refused_with_a_reason(text, grammar, reason):
    refused = reject_reason(text, grammar)
    assert refused is not None and reason in refused, refused


def test_tokens_are_ascii_and_whitespace_free():
    assert [t.text for t in tokenize("2*x**3 -\n1")] == ["2", "*", "x", "**", "3", "-", "1"]


@examples(300)
@given(st.one_of(st.text(max_size=300), st.text(alphabet="0123456789x()*^+-/., []'_Qe", max_size=300)))
def test_reading_never_raises_and_is_fast(text):
    start = time.monotonic()
    for grammar in (Expression(), INTEGRAL, Literal(), BOARD, Integer()):
        assert reject_reason(text, grammar) is None or isinstance(reject_reason(text, grammar), str)
    assert time.monotonic() - start < 0.5
