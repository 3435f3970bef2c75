"""The tools selfopd ships for tool-calling episodes (`selfopd.episodes.tools`): a calculator and a
Python sandbox. Each is a plain typed function whose docstring is its definition in the prompt
(transformers' `get_json_schema`), as TRL's tools are; each raises `ValueError` (or `RuntimeError`)
with one line for input it will not take, which the episode shows the student as the call's result.

Their arguments are model text. The calculator reads it with `ast` and computes it with a fixed
table of operators under size bounds, never `eval`; the Python tool runs it only inside the
bubblewrap sandbox of `selfopd.verifiers.code_runner`.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from selfopd.verifiers.code_runner import CodeLimits, run_test
from selfopd.verifiers.code_tests import StdinTest

MAX_EXPRESSION_CHARS = 500
MAX_BITS = 4096  # an integer past 2**4096 (1,234 digits) is refused: no expression runs long or fills memory
QUOTE_CHARS = 60  # of the student's text, quoted in an error
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}

# The Python tool: a program's limits in its sandbox, and what of its output comes back.
PYTHON_LIMITS = CodeLimits(time_s=2.0, kill_after_s=2.0, memory_bytes=1 << 30, stdout_bytes=8 << 10,
                           stderr_bytes=8 << 10)
MAX_CODE_CHARS = 20_000
MAX_OUTPUT_CHARS = 1200  # of stdout, of stderr, of the error: within `environment.MAX_MESSAGE_CHARS` together


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: integers exactly, / as a decimal.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "(37 + 5) * 41 - 2 ** 10"
    """
    value = evaluate(expression)
    return str(value) if isinstance(value, int) else repr(value)


def evaluate(expression: str) -> int | float:
    """`expression`'s value as Python computes it, or ValueError in one line: what is not arithmetic,
    a division by zero, a number past `MAX_BITS`, a result that is not a finite real number."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression is {type(expression).__name__}, not text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression):,} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"{quote(expression)} is not an arithmetic expression") from None
    try:
        return _value(tree.body, expression.strip())
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large for the calculator") from None
    except RecursionError:
        raise ValueError("the expression nests too deep") from None


def _value(node: ast.AST, source: str) -> int | float:
    """One node's value: a number, a unary or binary operation of the table; anything else refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand, source)))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left, source), _value(node.right, source)
        if isinstance(node.op, ast.Pow):  # the one operator whose result can outgrow its operands' bounds by far
            _check_power(left, right)
        return _bounded(_OPERATORS[type(node.op)](left, right))
    shown = ast.get_source_segment(source, node) or type(node).__name__
    raise ValueError(f"{quote(shown)} is not arithmetic: only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass `MAX_BITS` before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (base.bit_length() - 1) * exponent > MAX_BITS:
            raise OverflowError


def _bounded(value: Any) -> int | float:
    """`value` if it is a number within the bounds: an int of at most `MAX_BITS`, a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # a complex root of a negative number
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise OverflowError
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    return value


def python(code: str) -> str:
    """Runs a Python program in a sandbox (no network, no files, a few seconds) and returns what it printed.

    Args:
        code: the whole program; print() what you want to see
    """
    if not isinstance(code, str):
        raise ValueError(f"the code is {type(code).__name__}, not text")
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"the code has {len(code):,} characters; at most {MAX_CODE_CHARS:,}")
    result = run_test(code, StdinTest("", ""), PYTHON_LIMITS)
    if result.status == "sandbox_unavailable":
        raise RuntimeError(f"no sandbox to run it in here: {result.error}")
    shown = _cut(result.actual)
    if result.status in ("passed", "wrong"):  # it ran to the end (against no expected output)
        return shown + (f"\n[stderr]\n{_cut(result.debug)}" if result.debug.strip() else "")
    return (shown + "\n" if shown else "") + f"error: {_cut(result.error)}"


def _cut(text: str) -> str:
    """A program's output cut at `MAX_OUTPUT_CHARS`, saying how much was cut: stdout, stderr and the
    error together stay within what an episode shows of a tool's result."""
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return f"{text[:MAX_OUTPUT_CHARS]}\n[... {len(text) - MAX_OUTPUT_CHARS:,} more characters cut]"


def quote(text: str) -> str:
    """`text` as an error quotes it: repr (escapes, one line), cut at `QUOTE_CHARS`."""
    return repr(text[:QUOTE_CHARS]) + ("..." if len(text) > QUOTE_CHARS else "")
