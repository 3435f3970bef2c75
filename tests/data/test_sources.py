"""The loaders refuse, in one DataError naming the source, what would hang or fail deep in a
library: a generator option, size or pace that would take hours, a generator that fails on its
options, a data file that is a folder, a device or not UTF-8."""

from __future__ import annotations

import time

import pytest

from selfopd.data import DataError, load_examples, parse_data_spec


@pytest.mark.parametrize("spec, pattern", [
    ("rg:chain_sum?max_terms=100000000&size=1", r"^rg:chain_sum: option max_terms=100000000 must be within "
                                                r"\[-100000, 100000\]"),
    ("rg:chain_sum?min_terms=nan&size=1", r"option min_terms=nan must be within"),
    ("rg:basic_arithmetic?max_digits=1e300&size=1", r"option max_digits=1e\+300 must be within"),
    ("rg:chain_sum?min_digits=100000&max_digits=100000&min_terms=2&max_terms=2&size=1",
     r"^rg:chain_sum row 0: the generator failed with options .*: ValueError: Exceeds the limit"),
])
def test_a_generator_option_that_would_hang_or_fail_is_one_error(spec, pattern):
    started = time.monotonic()
    with pytest.raises(DataError, match=pattern):
        load_examples(spec)
    assert time.monotonic() - started < 10


def test_an_option_up_to_its_own_default_is_taken():
    assert len(load_examples("rg:count_bits?max_n=2147483647&size=3")) == 3  # its default is past 10^5



REWIRE = "vars(__import__('sympy')).update(parse_expr=callable),"


def test_an_item_whose_reference_would_run_as_code_is_refused_naming_its_row(monkeypatch):
    """The row check stands on its own: with the option check out of the way (as for a generator that
    copies text into its items some other way), the item whose reference is code is refused."""
    from selfopd.data import sources

    monkeypatch.setattr(sources, "checked_options", lambda task, config_class, options: dict(options), raising=False)
    spec = (f"rg:polynomial_multiplication?size=2&variables={REWIRE}&allow_cross_variable_product=true"
            "&allow_multivariate_polynomials=true")
    with pytest.raises(DataError) as caught:
        load_examples(spec)
    assert str(caught.value) == (
        "rg:polynomial_multiplication row 0: metadata 'variables' holds \"vars(__import__('sympy')).update(parse_expr="
        "callable)\", not a plain name; an item's reference and metadata must read in its task's grammar (generator "
        f"options {parse_data_spec(spec).task_config})")


def test_items_that_would_take_hours_are_refused_at_the_pace_of_the_first():
    started = time.monotonic()
    with pytest.raises(DataError, match=r"^rg:chain_sum: \d+ of 100000 items took \d+ s, so all of them would take "
                                        r"about \d+ s, past the 120 s selfopd gives a generator"):
        load_examples("rg:chain_sum?min_terms=20000&max_terms=20000&size=100000")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("make, pattern", [
    (lambda tmp: (tmp / "d.jsonl").mkdir() or tmp / "d.jsonl", r"d\.jsonl: is a folder, not a data file"),
    (lambda tmp: (tmp / "d.csv").write_bytes(b"prompt,answer\ncaf\xe9,2\n") and tmp / "d.csv",
     r"d\.csv:2: not UTF-8 text \(byte 0xe9 at column 4\); save the file as UTF-8"),
    (lambda tmp: (tmp / "d.json").write_bytes(b'[{"prompt": "\xff", "answer": "1"}]') and tmp / "d.json",
     r"d\.json:1: not UTF-8 text \(byte 0xff at column 14\)"),
])
def test_a_data_file_that_is_a_folder_or_not_utf8_is_named(tmp_path, make, pattern):
    with pytest.raises(DataError, match=pattern):
        load_examples(str(make(tmp_path)))


# --------------------------------------------------------------------------- hub data options

def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SOLVED = [{"problem": "Half of 1?", "solution": r"First $\boxed{2}$ is wrong; it is $\boxed{\frac{1}{2}}$."},
          {"problem": "Two plus two?", "solution": r"So \boxed {4}."}]


def test_the_answer_is_the_last_boxed_of_a_column(tmp_path):
    """answer=boxed:COLUMN: the last complete \\boxed{} (braces balanced), the whole text the solution
    unless a solution column is named; a preset's answer_sep does not apply then."""
    path = _jsonl(tmp_path / "math.jsonl", SOLVED)
    examples = load_examples(f"{path}?prompt=problem&answer=boxed:solution")
    assert [(ex.answer, ex.solution) for ex in examples] == [(r"\frac{1}{2}", SOLVED[0]["solution"]),
                                                             ("4", SOLVED[1]["solution"])]
    gsm = _jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": r"so \boxed{7} #### 7"}])
    assert load_examples(f"{gsm}?preset=openai/gsm8k&answer=boxed:answer")[0].answer == "7"


@pytest.mark.parametrize("solution", ["No box here.", r"Cut off: \boxed{\frac{1}{2}", r"Empty: \boxed{ }"])
def test_a_row_without_a_boxed_answer_is_one_error_naming_spec_and_row(tmp_path, solution):
    path = _jsonl(tmp_path / "math.jsonl", SOLVED + [{"problem": "p", "solution": solution}])
    with pytest.raises(DataError, match=rf"^{path} row 2: field 'answer' \(answer=boxed:solution\) has no complete, "
                                        r"non-empty \\boxed\{\.\.\.\}"):
        load_examples(f"{path}?prompt=problem&answer=boxed:solution")


@pytest.mark.parametrize("solution", ["No box here.", r"Cut off: \boxed{\frac{1}{2}", ""])
def test_unanswered_drop_leaves_out_and_names_the_rows_without_an_answer(tmp_path, capsys, solution):
    path = _jsonl(tmp_path / "math.jsonl", [SOLVED[0], {"problem": "p", "solution": solution}, SOLVED[1]])
    examples = load_examples(f"{path}?prompt=problem&answer=boxed:solution&unanswered=drop")
    assert [ex.prompt for ex in examples] == ["Half of 1?", "Two plus two?"]
    assert [ex.meta["row"] for ex in examples] == [0, 2]  # rows keep their numbers
    assert capsys.readouterr().err.strip().splitlines()[-1] == (  # after datasets' progress bar
        f"selfopd: warning: {path}: 1 of 3 rows have no answer (column 'solution', no complete \\boxed{{}}) and were "
        "left out (unanswered=drop): rows 1")
    with pytest.raises(DataError, match="unanswered must be 'refuse' or 'drop'"):
        load_examples(f"{path}?prompt=problem&answer=boxed:solution&unanswered=skip")


def test_opsd_s_training_set_preset_reads_its_answer_from_the_solution_s_last_boxed(tmp_path):
    """siyanzhao/Openthoughts_math_30k_opsd (OPSD's opsd_train.py): problem, solution; the answer is the
    solution's last \\boxed{} (OPSD's teacher reads the solution; selfopd's held-out eval needs the answer)."""
    path = _jsonl(tmp_path / "opsd.jsonl", SOLVED)
    examples = load_examples(f"{path}?preset=siyanzhao/Openthoughts_math_30k_opsd")
    assert [(ex.prompt, ex.answer, ex.solution) for ex in examples] == [
        ("Half of 1?", r"\frac{1}{2}", SOLVED[0]["solution"]), ("Two plus two?", "4", SOLVED[1]["solution"])]


@pytest.mark.parametrize("spec, pattern", [
    ("d.jsonl?answer=boxed:", r"^d.jsonl: answer=boxed: names no column"),
    ("d.jsonl?answer=boxed:solution&answer_sep=####", r"answer=boxed:solution and answer_sep both say where"),
    ("d.jsonl?revision=v1", r"option 'revision' .*does not apply|unknown option 'revision'"),
])
def test_hub_data_options_that_cannot_work_are_refused(spec, pattern):
    with pytest.raises(DataError, match=pattern):
        parse_data_spec(spec)


def test_a_dataset_revision_reaches_the_hub_loader():
    """revision=REV is load_dataset's revision (checked on the arguments load_hub passes: offline, no
    hub dataset can be loaded), and an offline failure names it."""
    from selfopd.data.sources import hub_request

    spec = parse_data_spec("hf:openai/gsm8k?revision=e53f048&split=test")
    assert str(spec) == "hf:openai/gsm8k?split=test&revision=e53f048"
    assert hub_request(spec) == {"path": "openai/gsm8k", "name": "main", "split": "test", "revision": "e53f048"}
    assert hub_request(parse_data_spec("hf:org/ds"))["revision"] is None
    with pytest.raises(DataError, match=r"could not load Hub dataset 'org/ds' \(config None, split 'train', "
                                        r"revision 'v1'\)"):
        load_examples("hf:org/ds?revision=v1")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_only_the_columns_a_spec_uses_are_kept(tmp_path, suffix):
    """Unused columns (here a 200 KB trace per row) are dropped before any row is read: no example
    holds them; a `teacher` column stays, for routing."""
    import pandas as pd

    rows = [{"q": f"What is {i}?", "a": str(i), "trace": "x" * 200_000, "scores": list(range(1000)),
             "teacher": "tutor" if i else ""} for i in range(4)]
    path = tmp_path / f"big{suffix}"
    frame = pd.DataFrame(rows)
    frame.to_parquet(path) if suffix == ".parquet" else frame.to_json(path, orient="records", lines=True)
    examples = load_examples(f"{path}?prompt=q&answer=a")
    assert [ex.meta["extra"] for ex in examples] == [{"teacher": ""}] + [{"teacher": "tutor"}] * 3
    assert all("x" * 1000 not in repr(ex) for ex in examples)
    frame.drop(columns="teacher").to_parquet(path) if suffix == ".parquet" else \
        frame.drop(columns="teacher").to_json(path, orient="records", lines=True)
    assert load_examples(f"{path}?prompt=q&answer=a")[0].meta["extra"] == {}


@pytest.mark.parametrize("text", [r"\boxed{1} then \boxed{\frac{1}{2}}", r"\boxed{\{1, 2\}}", r"\fbox{3} \boxed {4}",
                                  r"\boxed{5} \boxed{", r"\boxed{} \boxed{ 6 }", r"\boxedx{7} \boxed{\boxed{8}}",
                                  r"\boxed{a\}b}", "no box", r"\boxed{9}\\"])
def test_the_loaders_boxed_reader_agrees_with_the_verifiers(text):
    """The loader reads \\boxed{} itself: as the grader does."""
    from selfopd.data.sources import last_boxed
    from selfopd.verifiers.extract import extract_boxed

    assert last_boxed(text) == extract_boxed(text)
