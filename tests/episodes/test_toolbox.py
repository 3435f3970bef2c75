"""The tools selfopd ships: the calculator against Python's own arithmetic and against hostile
expressions, and the Python tool inside its sandbox."""

from __future__ import annotations

import random
import re
import time

import pytest

from selfopd.episodes.toolbox import MAX_OUTPUT_CHARS, calculator, evaluate, python
from selfopd.verifiers import isolation

NEEDS_SANDBOX = pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                   reason=f"no sandbox here: {isolation.unavailable_reason()}")
_ARITHMETIC = re.compile(r"[0-9+\-*/%(). ]+")


def _expression(rng: random.Random, depth: int) -> str:
    """A random expression of small numbers, every operator, unary signs, redundant parentheses and
    odd spacing; exponents stay small literals, so Python computes every one in a blink."""
    if depth == 0 or rng.random() < 0.25:
        number = rng.choice([str(rng.randint(0, 99)), f"{rng.randint(0, 99)}.{rng.randint(0, 9)}", "0"])
        return rng.choice(["", "-", "+", "--"]) + number
    if rng.random() < 0.15:
        return f"{rng.choice(['-', '+'])}({_expression(rng, depth - 1)})"
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    left = _expression(rng, depth - 1)
    right = rng.choice(["0", "1", "2", "3", "-1", "-2"]) if op == "**" else _expression(rng, depth - 1)
    if op == "**":
        left = f"({left})" if rng.random() < 0.5 else rng.choice(["2", "-3", "1.5", "7"])
    text = f"{left}{' ' * rng.randint(0, 1)}{op}{' ' * rng.randint(0, 1)}{right}"
    return f"({text})" if rng.random() < 0.4 else text


def _python_value(expression: str):
    """The reference: Python's own evaluation of an expression this test generated (digits, operators
    and parentheses only, checked here; never model text), or the exception it raises."""
    assert _ARITHMETIC.fullmatch(expression)
    try:
        return eval(compile(expression, "<reference>", "eval"), {"__builtins__": {}})  # noqa: S307
    except ArithmeticError as error:
        return error


def test_the_calculator_computes_what_python_computes_on_random_expressions():
    rng = random.Random(62)
    compared = errors = 0
    for _ in range(3000):
        expression = _expression(rng, rng.randint(1, 4))
        expected = _python_value(expression)
        if isinstance(expected, complex):  # a fractional power of a negative number
            with pytest.raises(ValueError, match="not a real number"):
                evaluate(expression)
        elif isinstance(expected, ArithmeticError):
            with pytest.raises(ValueError, match="division by zero|too large"):
                evaluate(expression)
            errors += 1
        else:
            value = evaluate(expression)
            assert type(value) is type(expected) and (value == expected or value != value and expected != expected), \
                (expression, value, expected)
            assert calculator(expression) == (str(expected) if isinstance(expected, int) else repr(expected))
        compared += 1
    assert compared == 3000 and 30 < errors < 1500  # divisions by zero came up, and most expressions computed


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('id')", "is not arithmetic"),
    ("().__class__.__bases__[0].__subclasses__()", "is not arithmetic"),
    ("(lambda: 1)()", "is not arithmetic"),
    ("x + 1", "is not arithmetic"),
    ("'7' * 3", "is not arithmetic"),
    ("True + 1", "is not arithmetic"),
    ("2j * 2", "is not arithmetic"),
    ("[1, 2][0]", "is not arithmetic"),
    ("1 if 1 else 2", "is not arithmetic"),
    ("1 < 2", "is not arithmetic"),
    ("9 ** 9 ** 9", "too large"),
    ("2 ** 5000", "too large"),
    ("(2 ** 4000) * (2 ** 4000)", "too large"),
    ("10 ** 300 * 1e300", "too large"),
    ("1e308 * 10", "too large"),
    ("7 / 0", "division by zero"),
    ("7 % (3 - 3)", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1\x00 + 2", "not an arithmetic expression"),
    ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression"),  # past the parser's nesting limit
    ("(" * 150 + "1" + ")" * 150, None),
    ("-" * 499 + "1", None),
    ("1" * 501, "at most 500"),
    ("9" * 400, None),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic_in_one_line(expression, says):
    began = time.monotonic()
    if says is None:
        calculator(expression)  # within the bounds: computed
    else:
        with pytest.raises(ValueError, match=says) as raised:
            calculator(expression)
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 200
    assert time.monotonic() - began < 1


def test_the_calculator_is_exact_on_integers():
    assert calculator("2 ** 100 + 1") == "1267650600228229401496703205377"
    assert calculator("-2 ** 2") == "-4" and calculator("(-2) ** 2") == "4"
    assert calculator(" 7 // -2 ") == "-4" and calculator("-7 % 3") == "2" and calculator("1 / 4") == "0.25"


@NEEDS_SANDBOX
def test_the_python_tool_runs_a_program_and_returns_what_it_printed():
    assert python("print(sum(range(10)))") == "45\n"
    assert "ZeroDivisionError" in python("print('before')\n1 / 0")
    assert python("import sys; sys.stdout.buffer.write(bytes([0xff, 0x41]))") == "\ufffdA"


@NEEDS_SANDBOX
def test_the_python_tool_reaches_nothing_of_the_trainer(monkeypatch):
    monkeypatch.setenv("SELFOPD_TEST_SECRET", "hunter2")
    assert python("import os; print(os.environ.get('SELFOPD_TEST_SECRET'))") == "None\n"
    assert "PermissionError" in python("print(open('/proc/1/environ').read())")
    network = python("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')")
    assert "connected" not in network and "error:" in network


@NEEDS_SANDBOX
def test_the_python_tool_stops_a_program_at_its_limits_with_one_line():
    # A busy loop meets its CPU limit (or, on a loaded machine, the wall clock first); a sleep the wall clock.
    assert python("while True: pass") in ("error: CPU time limit (2 s)", "error: killed at the wall-clock limit (4 s)")
    assert python("import time\ntime.sleep(60)") == "error: killed at the wall-clock limit (4 s)"
    flood = python("print('x' * 100_000)")
    assert len(flood) < 3 * MAX_OUTPUT_CHARS and "more characters cut" in flood and flood.endswith(
        "error: output limit: more than 8192 bytes on stdout")
    with pytest.raises(ValueError, match="at most 20,000"):
        python("#" * 20_001)
