"""Normalisation, exact plain-number parsing, and the cost pre-screen (all in-process, fast)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from selfopd.verifiers.normalize import normalize_answer
from selfopd.verifiers.numeric import parse_plain_number
from selfopd.verifiers.prescreen import MAX_ANSWER_CHARS, log10_of_tower, too_costly


@pytest.mark.parametrize(
    "raw, canonical",
    [
        ("$5$", "5"),
        (r"\$5", "5"),
        (r"\$1,234", "1234"),
        ("1,234,567.5", "1234567.5"),
        ("1{,}234", "1234"),
        (r"1\,000", "1000"),
        (r"\(x^2\)", "x^2"),
        (r"\[ 7 \]", "7"),
        (r"\text{(B)}", "B"),
        (r"\textbf{yes}", "yes"),
        (r"\mathrm{5 km/h}", "5"),
        ("5 apples", "5"),
        ("18 dollars.", "18"),
        ("12 cm^2", "12"),
        (r"5\text{ cm}", "5"),
        ("2 pi", "2 pi"),  # pi is math, not a unit
        ("3 and 4", "3 and 4"),
        ("x cm", "x cm"),  # units only after a plain number
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        ("90\u00b0", "90"),
        (r"50\%", "50%"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac34", r"\frac34"),
        (r"\left( 1, 2 \right)", "( 1, 2 )"),
        (r"\left\{ 1, 2 \right\}", r"\{ 1, 2 \}"),
        (r"a\!b", "ab"),
        ("**42**", "42"),
        ("3.", "3"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        ("\u22123", "-3"),
        ("x = 3", "x = 3"),
        ("  spaced   out  ", "spaced out"),
        ("(c)", "c"),
        (r"\displaystyle\frac{1}{2}", r"\frac{1}{2}"),
        ("1,2", "1,2"),  # not a thousands group: a list stays a list
    ],
)
def test_normalize_answer(raw, canonical):
    assert normalize_answer(raw) == canonical


@pytest.mark.parametrize(
    "text, values, is_fraction",
    [
        ("42", {42}, False),
        ("-2.5", {Fraction(-5, 2)}, False),
        ("+7", {7}, False),
        ("- 7", {-7}, False),
        (".5", {Fraction(1, 2)}, False),
        ("1e3", {1000}, False),
        ("2.5E-2", {Fraction(1, 40)}, False),
        ("3/4", {Fraction(3, 4)}, True),
        ("-3/4", {Fraction(-3, 4)}, True),
        (r"\frac{3}{4}", {Fraction(3, 4)}, True),
        (r"-\frac{3}{4}", {Fraction(-3, 4)}, True),
        (r"\frac{-3}{4}", {Fraction(-3, 4)}, True),
        (r"\frac34", {Fraction(3, 4)}, True),
        ("50%", {50, Fraction(1, 2)}, False),
        ("x = 3", {3}, False),
        ("y_1 = -1", {-1}, False),
    ],
)
def test_parse_plain_number(text, values, is_fraction):
    parsed = parse_plain_number(text)
    assert parsed is not None
    assert parsed.values == frozenset(Fraction(v) for v in values)
    assert parsed.is_fraction == is_fraction


@pytest.mark.parametrize("text", ["x", "3x", "1/0", r"\frac{1}{0}", r"\sqrt{2}", "1e99999", "1, 2", "2^{10}", ""])
def test_parse_plain_number_rejects(text):
    assert parse_plain_number(text) is None


@pytest.mark.parametrize(
    "answer",
    [
        "10^{10^{10}}",
        "9^{9^{9^{9}}}",
        "9^9^9",
        "10**10**10",
        "2^3^4^5",
        "10^{100001}",
        "10^{-10^{10}}",  # tiny, but exact rationals are as costly as huge ones
        "e^{10^{10}}",
        "(1+x)^{1000000}",
        "100000!",
        "123456789012345678901234567890!",
        "(10^{5})!",
        "{10^{10}}!",
        "1" * (MAX_ANSWER_CHARS + 1),
    ],
)
def test_too_costly(answer):
    assert too_costly(answer) is not None


@pytest.mark.parametrize(
    "answer",
    ["2^{2^{5}}", "10^{100000}", "2^{10}", "x^{2}", "x^2+1", "2^{-3}", "{2^{3}}^{4}", "20000!", "(3+2)!",
     "0^{10^{10}}", "x^{y^{z}}", "2^{", "^^^^", r"\frac{1}{2}", "2**100"],
)
def test_not_too_costly(answer):
    assert too_costly(answer) is None


def test_log10_of_tower():
    assert log10_of_tower("2^{2^{5}}") == pytest.approx(32 * 0.30103, rel=1e-4)
    assert log10_of_tower("{2^{3}}^{4}") == pytest.approx(12 * 0.30103, rel=1e-4)
    assert log10_of_tower("9^{9^{9^{9}}}") == float("inf")
    assert log10_of_tower("x^2") is None
