"""The tests a model-written program is run against, read from a task's metadata.

Three shapes, one per row (a mapping with exactly these keys):

  - ``{"stdin": str, "stdout": str}``: the program reads `stdin` and its whole output is compared,
    outside the sandbox, with `stdout`, whitespace normalised per line (`same_output`).
  - ``{"call": "f(1, 2)", "expected": "3"}``: the program defines functions; a fixed harness inside
    the sandbox imports it, evaluates the call (one Python call expression from the task, never from
    the model) and prints `repr()` of its value. `expected` is a Python literal, read here with
    `ast.literal_eval` (never `eval`), and compared outside: the program never sees it.
  - ``{"check": "def check(candidate): assert ...", "entry_point": "f"}``: HumanEval's form,
    ``check(f)`` run inside the sandbox, in the program's own process. This form shows the test to
    the program (its asserts, expected values included), and a program can forge its verdict; use
    stdin or call tests where that matters (hidden tests, rewards a student could game).

`parse_test` refuses a malformed row with one line (`CodeTestError`) that names the field.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

_SHAPES = {frozenset({"stdin", "stdout"}): "stdin", frozenset({"call", "expected"}): "call",
           frozenset({"check", "entry_point"}): "check"}


PROGRAM = "solution.py"  # the program's file name in its sandbox (tracebacks show it)


class CodeTestError(ValueError):
    """A test row that cannot be run; the message is one line naming the row and the field."""


@dataclass(frozen=True)
class StdinTest:
    stdin: str
    stdout: str


@dataclass(frozen=True)
class CallTest:
    call: str
    expected: str  # the literal as written; `value` is what it reads as
    value: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CheckTest:
    check: str
    entry_point: str


CodeTest = Union[StdinTest, CallTest, CheckTest]


def _text(row: Mapping[str, Any], key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise CodeTestError(f"{where}: field '{key}' must be a string, not {type(value).__name__}")
    return value


def _literal(text: str) -> Any:
    """`text` read as a Python literal (ValueError, SyntaxError, MemoryError or RecursionError if not)."""
    return ast.literal_eval(text.strip())


def parse_test(row: Any, where: str = "test") -> CodeTest:
    """One test from its metadata row, or CodeTestError in one line naming `where` and the field."""
    if isinstance(row, (StdinTest, CallTest, CheckTest)):
        return row
    if not isinstance(row, Mapping):
        raise CodeTestError(f"{where}: a test is a mapping, not {type(row).__name__}")
    keys = frozenset(row)
    shape = _SHAPES.get(keys)
    if shape is None:
        for shape_keys in _SHAPES:  # the shape it shares a key with names the missing or extra field
            if keys & shape_keys:
                missing, extra = sorted(shape_keys - keys), sorted(keys - shape_keys)
                name = missing[0] if missing else extra[0]
                raise CodeTestError(f"{where}: field '{name}' " + ("is missing" if missing else "is not expected")
                                    + f" (a test has keys {' + '.join(sorted(shape_keys))})")
        raise CodeTestError(f"{where}: fields {sorted(map(str, keys))} match no test shape "
                            "(stdin + stdout, call + expected, check + entry_point)")
    if shape == "stdin":
        return StdinTest(_text(row, "stdin", where), _text(row, "stdout", where))
    if shape == "call":
        call, expected = _text(row, "call", where), _text(row, "expected", where)
        try:
            tree = ast.parse(call.strip(), mode="eval")
        except SyntaxError as e:
            raise CodeTestError(f"{where}: field 'call' is not a Python expression ({e.msg})") from None
        if not isinstance(tree.body, ast.Call):
            raise CodeTestError(f"{where}: field 'call' must be one function call, like f(1, 2)")
        try:
            value = _literal(expected)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
            raise CodeTestError(f"{where}: field 'expected' is not a Python literal ({type(e).__name__})") from None
        return CallTest(call, expected, value)
    check, entry_point = _text(row, "check", where), _text(row, "entry_point", where)
    if not entry_point.isidentifier():
        raise CodeTestError(f"{where}: field 'entry_point' must be a Python name, not {entry_point[:60]!r}")
    try:
        tree = ast.parse(check)
    except SyntaxError as e:
        raise CodeTestError(f"{where}: field 'check' is not valid Python ({e.msg}, line {e.lineno})") from None
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise CodeTestError(f"{where}: field 'check' must define check(candidate)")
    return CheckTest(check, entry_point)


def parse_tests(rows: Iterable[Any], where: str = "tests") -> list[CodeTest]:
    """Every test of a list (a row's place is named in an error: tests[3])."""
    if isinstance(rows, (str, bytes, Mapping)):
        raise CodeTestError(f"{where}: a list of tests, not {type(rows).__name__}")
    return [parse_test(row, f"{where}[{index}]") for index, row in enumerate(rows)]


def normalise_output(text: str) -> list[str]:
    """Output lines with runs of whitespace made one space, ends stripped, trailing blank lines dropped."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_output(actual: str, expected: str) -> bool:
    """Whether a program's whole output is the expected one, whitespace normalised per line."""
    return normalise_output(actual) == normalise_output(expected)


def same_value(actual: Any, expected: Any, float_tolerance: float = 1e-9) -> bool:
    """Literal values equal, floats within a relative `float_tolerance`, containers element by element;
    a bool is not an int here (True is not 1)."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, float) or isinstance(expected, float):
        if not (isinstance(actual, (int, float)) and isinstance(expected, (int, float))):
            return False
        if actual == expected:
            return True
        return abs(actual - expected) <= float_tolerance * max(abs(actual), abs(expected))
    if isinstance(expected, (list, tuple)):
        return (type(actual) is type(expected) and len(actual) == len(expected)
                and all(same_value(a, e, float_tolerance) for a, e in zip(actual, expected)))
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and actual.keys() == expected.keys()
                and all(same_value(actual[k], expected[k], float_tolerance) for k in expected))
    try:
        return type(actual) is type(expected) and bool(actual == expected)
    except Exception:  # noqa: BLE001  # literals compare without raising; be safe anyway
        return False


def describe(test: CodeTest) -> tuple[str, str]:
    """(input, expected) of a test as feedback shows them."""
    if isinstance(test, StdinTest):
        return test.stdin, test.stdout
    if isinstance(test, CallTest):
        return test.call, test.expected
    return test.check, f"check({test.entry_point}) to pass"


_FRAME = re.compile(r'^\s*File "([^"]*)", line \d+')


def error_tail(stderr: str, max_frames: int = 3, max_chars: int = 2000) -> str:
    """The last traceback in `stderr`, cut to the program's own frames (its last `max_frames`) and the
    exception lines; stderr's last line when there is no traceback."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        last = next((line for line in reversed(lines) if line.strip()), "")
        return last[-max_chars:]
    block = lines[starts[-1] + 1:]
    frames: list[list[str]] = []
    exception: list[str] = []
    for line in block:
        if _FRAME.match(line):
            frames.append([line])
        elif line.startswith(" ") and frames and not exception:
            frames[-1].append(line)
        else:
            exception.append(line)
    own = [f for f in frames if _FRAME.match(f[0]).group(1).endswith(PROGRAM)]  # type: ignore[union-attr]
    kept = [line for frame in own[-max_frames:] for line in frame]
    text = "\n".join(["Traceback (most recent call last):", *kept, *exception] if kept else exception)
    return text[-max_chars:]
