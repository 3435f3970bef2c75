"""What a code task's tests look like, checked when a row is loaded; nothing here runs anything.

A code task carries its tests in `Example.meta["code"]`:

    {"entry_point": "f" | None,              the function the tests call (None: a stdin program)
     "tests":  [test, ...],                  shown: may appear in the feedback a teacher reads
     "hidden": [test, ...]}                  never in any feedback: the held-back check of a program

and a test is one of
    {"stdin": str, "stdout": str}                          a program's input and expected output
    {"call": "f(1, 'a')", "expected": "3"}                 a call of the entry point on literal arguments and
                                                           its value, both Python literals (ast.literal_eval)
    {"check": "def check(candidate): ...", "entry_point": "f"}  HumanEval's harness, handed the function

`Example.answer` of a code task is a reference solution's text, for display only. The programs a model
writes run only in the sandboxed runner (`selfopd.verifiers.code_runner`); the loader only parses:
`ast.parse` for calls and check functions, `ast.literal_eval` for literal values (a parser, never `eval`).
A row that breaks a rule is refused with one line naming the row and the field.
"""

from __future__ import annotations

import ast
import keyword
from typing import Any

from selfopd.data.spec import DataError

MAX_TEST_CHARS = 10_000  # a test's field (an input, an output, a call, a check function)
MAX_TESTS = 200  # shown and hidden together
MAX_NAME_CHARS = 100  # an entry point's name
SHAPES = {frozenset({"stdin", "stdout"}): "stdin", frozenset({"call", "expected"}): "call",
          frozenset({"check", "entry_point"}): "check"}
_PARSE_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError)


def is_entry_point(name: Any) -> bool:
    """A plain Python name: what a test may call."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and name.isidentifier() \
        and not keyword.iskeyword(name)


def literal(text: str) -> Any:
    """The value a literal's text stands for, by `ast.literal_eval` (a ValueError, SyntaxError, ... when
    the text is not a literal: a name, a call, an operator beyond a sign or a complex number)."""
    return ast.literal_eval(text)


def call_error(call: str, entry_point: str | None) -> str | None:
    """Why `call` is not `ENTRY(literal, ..., name=literal)`: one call of the entry point on literal arguments."""
    if entry_point is None:
        return "a call test needs the task's entry_point"
    try:
        node = ast.parse(call.strip(), mode="eval").body
    except _PARSE_ERRORS as error:
        return f"does not parse ({type(error).__name__})"
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return f"is not a call of {entry_point}(...)"
    if node.func.id != entry_point:
        return f"calls {node.func.id!r}, not the entry point {entry_point!r}"
    for arg in [*node.args, *node.keywords]:
        value = arg.value if isinstance(arg, (ast.keyword, ast.Starred)) else arg
        if isinstance(arg, ast.Starred) or (isinstance(arg, ast.keyword) and arg.arg is None):
            return "unpacks its arguments (* or **); arguments must be literals"
        try:
            ast.literal_eval(value)
        except _PARSE_ERRORS:
            return f"argument {ast.unparse(value)[:60]!r} is not a literal"
    return None


def check_function_error(check: str) -> str | None:
    """Why `check` is not a module that defines `check(candidate)` (parsed, never run)."""
    try:
        tree = ast.parse(check)
    except _PARSE_ERRORS as error:
        return f"does not parse ({type(error).__name__})"
    defined = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if not defined or len(defined[-1].args.args) != 1:
        return "defines no check(candidate) function"
    return None


def _test_error(test: Any, entry_point: str | None) -> tuple[str, str] | None:
    """(field, why) for a test that breaks the rules, else None."""
    if not isinstance(test, dict):
        return "", f"expected an object, got {type(test).__name__}"
    shape = SHAPES.get(frozenset(test))
    if shape is None:
        return "", (f"keys {sorted(test)} are none of the test shapes: {{stdin, stdout}}, {{call, expected}}, "
                    "{check, entry_point}")
    for key, value in test.items():
        if not isinstance(value, str):
            return f".{key}", f"expected text, got {type(value).__name__}"
        if len(value) > MAX_TEST_CHARS:
            return f".{key}", f"{len(value)} characters, past the {MAX_TEST_CHARS} a test's field may hold"
    if shape == "call":
        why = call_error(test["call"], entry_point)
        if why:
            return ".call", why
        try:
            literal(test["expected"])
        except _PARSE_ERRORS as error:
            return ".expected", f"is not a Python literal ({type(error).__name__}): {test['expected'][:60]!r}"
    if shape == "check":
        if test["entry_point"] != entry_point:
            return ".entry_point", f"{test['entry_point'][:60]!r} is not the task's entry point {entry_point!r}"
        why = check_function_error(test["check"])
        if why:
            return ".check", why
    return None


def check_code(code: Any, where: str) -> dict:
    """`code` as the rules above say, or a DataError naming `where` and the field (meta.code.hidden[2].call)."""
    def refuse(field: str, why: str) -> DataError:
        return DataError(f"{where}: field 'meta.code{field}': {why}")

    if not isinstance(code, dict) or set(code) != {"entry_point", "tests", "hidden"}:
        keys = sorted(code) if isinstance(code, dict) else type(code).__name__
        raise refuse("", f"expected the keys entry_point, tests, hidden; got {keys}")
    entry_point = code["entry_point"]
    if entry_point is not None and not is_entry_point(entry_point):
        raise refuse(".entry_point", f"{str(entry_point)[:60]!r} is not a Python name")
    for part in ("tests", "hidden"):
        if not isinstance(code[part], list):
            raise refuse(f".{part}", f"expected a list, got {type(code[part]).__name__}")
    total = len(code["tests"]) + len(code["hidden"])
    if not 0 < total <= MAX_TESTS:
        raise refuse("", f"{total} tests; a task has 1 to {MAX_TESTS}")
    for part in ("tests", "hidden"):
        for i, test in enumerate(code[part]):
            bad = _test_error(test, entry_point)
            if bad:
                raise refuse(f".{part}[{i}]{bad[0]}", bad[1])
    shown = {tuple(sorted(test.items())) for test in code["tests"]}
    for i, test in enumerate(code["hidden"]):
        if tuple(sorted(test.items())) in shown:
            raise refuse(f".hidden[{i}]", "repeats a shown test; a hidden test never appears in feedback")
    return {"entry_point": entry_point, "tests": [dict(t) for t in code["tests"]],
            "hidden": [dict(t) for t in code["hidden"]]}
