"""Data loading on real files, real reasoning-gym tasks and the real CHAMP set."""

import json
import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from selfopd.data import DataError, DataSpec, load_examples, parse_data_spec
from selfopd.data.example import prompt_key
from selfopd.data.split import SplitRecord, split_examples, trained_on
from selfopd.data.example import Example


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def table_rows(n=5):
    return [{"qid": f"q{i}", "question": f"What is {i} + 1?", "target": str(i + 1),
             "why": f"{i} + 1 = {i + 1}", "tips": f"count up from {i}", "level": i % 2}
            for i in range(n)]


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_field_mapping_for_each_file_type(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    frame = pd.DataFrame(table_rows())
    if suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    spec = f"{path}?id=qid&prompt=question&answer=target&solution=why&hints=tips"
    examples = load_examples(spec)
    assert [ex.id for ex in examples] == [f"q{i}" for i in range(5)]
    ex = examples[3]
    assert (ex.prompt, ex.answer, ex.solution) == ("What is 3 + 1?", "4", "3 + 1 = 4")
    assert ex.hints == ("count up from 3",)
    assert ex.meta["row"] == 3 and ex.meta["extra"] == {}  # unmapped columns dropped


def test_default_columns_and_generated_ids(tmp_path):
    rows = [{"prompt": "p0", "answer": 1}, {"prompt": "p1", "answer": 2}]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    examples = load_examples(str(path))
    assert [(ex.id, ex.prompt, ex.answer, ex.solution, ex.hints) for ex in examples] == [
        ("plain/0", "p0", "1", None, ()), ("plain/1", "p1", "2", None, ())]


def test_hints_list_column_vs_string_column(tmp_path):
    rows = [{"prompt": "a", "answer": "1", "hl": ["first", "second"], "hs": "only one"},
            {"prompt": "b", "answer": "2", "hl": [], "hs": ""}]
    pd.DataFrame(rows).to_parquet(tmp_path / "h.parquet")
    as_list = load_examples(f"{tmp_path / 'h.parquet'}?hints=hl")
    as_string = load_examples(f"{tmp_path / 'h.parquet'}?hints=hs")
    assert [ex.hints for ex in as_list] == [("first", "second"), ()]
    assert [ex.hints for ex in as_string] == [("only one",), ()]


def test_gsm8k_preset_on_a_gsm8k_shaped_local_file(tmp_path):
    worked = "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72."
    rows = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
             "answer": worked + "\n#### 72"},
            {"question": "Two plus two?", "answer": "2+2=4\n####  4 "}]
    path = write_jsonl(tmp_path / "gsm8k_test.jsonl", rows)
    examples = load_examples(f"{path}?preset=openai/gsm8k")
    assert [ex.answer for ex in examples] == ["72", "4"]
    assert examples[0].solution == worked
    assert examples[0].prompt == rows[0]["question"]
    write_jsonl(path, rows + [{"question": "No marker?", "answer": "5"}])
    with pytest.raises(DataError, match=r"row 2: .*'answer'.*'####'"):
        load_examples(f"{path}?preset=openai/gsm8k")


def test_math500_and_dapo_presets_on_local_files(tmp_path):
    math = write_jsonl(tmp_path / "math500.jsonl", [
        {"problem": "Compute 1/2 + 1/3.", "solution": "Over 6: $\\frac56$.", "answer": "\\frac{5}{6}",
         "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"}])
    ex = load_examples(f"{math}?preset=HuggingFaceH4/MATH-500")[0]
    assert (ex.id, ex.answer, ex.solution) == ("test/prealgebra/1.json", "\\frac{5}{6}", "Over 6: $\\frac56$.")
    assert ex.meta["extra"] == {}

    wrapped = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: \\boxed{$Answer} where $Answer is the answer to the problem.\n\nFind $a+b$ if "
               "$a=1$ and $b=2$.\n\nRemember to put your answer on its own line after \"Answer:\".")
    row = {"prompt": [{"content": wrapped, "role": "user"}], "label": "3"}
    dapo = write_jsonl(tmp_path / "dapo.jsonl", [row])
    ex = load_examples(f"{dapo}?preset=zhuzilin/dapo-math-17k")[0]
    assert (ex.prompt, ex.answer) == ("Find $a+b$ if $a=1$ and $b=2$.", "3")


def test_missing_field_names_source_row_and_field(tmp_path):
    rows = table_rows()
    del rows[3]["target"]
    path = write_jsonl(tmp_path / "my.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_examples(f"{path}?prompt=question&answer=target")
    message = str(err.value)
    assert str(path) in message and "row 3" in message
    assert "missing field 'answer'" in message and "column 'target'" in message


def test_column_absent_everywhere_lists_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "my.jsonl", table_rows())
    with pytest.raises(DataError, match=r"missing field 'prompt' \(mapped from column 'prompt'\).*question"):
        load_examples(str(path))


@pytest.mark.parametrize("field,value", [("question", ""), ("target", "   ")])
def test_empty_prompt_or_answer_is_an_error(tmp_path, field, value):
    rows = table_rows()
    rows[1][field] = value
    path = write_jsonl(tmp_path / "my.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_examples(f"{path}?prompt=question&answer=target")
    name = "prompt" if field == "question" else "answer"
    message = str(err.value)
    assert str(path) in message and "row 1" in message and f"empty field '{name}'" in message


def test_duplicate_ids_name_both_rows(tmp_path):
    rows = table_rows(6)
    rows[4]["qid"] = rows[1]["qid"]
    path = write_jsonl(tmp_path / "dups.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_examples(f"{path}?id=qid&prompt=question&answer=target")
    assert str(path) in str(err.value) and "'q1'" in str(err.value) and "rows 1 and 4" in str(err.value)


def test_limit_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "my.jsonl", table_rows())
    assert len(load_examples(f"{path}?prompt=question&answer=target&limit=2")) == 2
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_examples(str(tmp_path / "nope.jsonl"))


def test_hub_failure_offline_is_clear_and_fast(monkeypatch):
    import datasets
    import huggingface_hub

    # datasets reads these at import time, so set the module values as well as the env
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        load_examples("hf:selfopd-test/no-such-dataset-3141?split=test")
    assert time.monotonic() - start < 15
    message = str(err.value)
    assert "'selfopd-test/no-such-dataset-3141'" in message and "split 'test'" in message
    assert "network" in message and "local" in message


# --------------------------------------------------------------------------- spec strings


@pytest.mark.parametrize("text", [
    "rg:chain_sum?seed=1&size=50&min_terms=2&max_terms=3",
    "champ?concepts=true&limit=3",
    "hf:openai/gsm8k?config=main&split=test",
    "data/my.jsonl?prompt=question&answer=target&hints=tips&answer_sep=####",
])
def test_spec_round_trips(text):
    spec = parse_data_spec(text)
    assert str(spec) == text and parse_data_spec(str(spec)) == spec


def test_spec_values_are_typed():
    spec = parse_data_spec("rg:chain_sum?min_terms=2&allow_negation=true&ratio=0.5&mode=fast&seed=7")
    assert spec.task_config == {"min_terms": 2, "allow_negation": True, "ratio": 0.5, "mode": "fast"}
    assert spec.seed == 7 and spec.size == 500
    assert parse_data_spec("data/x.csv?prompt=1").prompt_col == "1"  # column names stay text
    assert parse_data_spec("champ?concepts=false") == DataSpec(source="champ")


@pytest.mark.parametrize("text,pattern", [
    ("gsm8k", r"unknown data source 'gsm8k'; allowed: rg:TASK, kb:TASK, champ, hf:NAME"),
    ("s3:bucket/x.jsonl", r"unknown data source 's3:'"),
    ("champ?seed=1", r"unknown option 'seed' for source 'champ'; allowed: concepts, distinct, limit"),
    ("x.jsonl?colour=red", r"unknown option 'colour' .*allowed: .*answer_sep.*prompt"),
    ("rg:chain_sum?size=many", r"option 'size': expected int"),
    ("x.jsonl?preset=gsm9k", r"unknown preset 'gsm9k'; allowed: openai/gsm8k"),
    ("x.jsonl?prompt", r"not KEY=VALUE"),
    ("hf:", r"needs a name"),
])
def test_spec_errors_name_the_problem(text, pattern):
    with pytest.raises(DataError, match=pattern):
        parse_data_spec(text)


def test_dataspec_rejects_options_of_another_source():
    with pytest.raises(DataError, match="option 'split' does not apply to source 'rg'"):
        DataSpec(source="rg", name="chain_sum", split="test")


# --------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_items_are_seeded_and_scorable():
    import reasoning_gym

    spec = "rg:chain_sum?min_terms=2&max_terms=3&max_digits=1&size=20&seed=1"
    first, again = load_examples(spec), load_examples(spec)
    other = load_examples(spec.replace("seed=1", "seed=2"))
    assert first == again
    assert [ex.prompt for ex in first] != [ex.prompt for ex in other]
    assert first[17].id == "chain_sum/seed1/17"
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    for ex in first:
        rg = ex.meta["reasoning_gym"]
        assert rg["task"] == "chain_sum" and ex.prompt == rg["entry"]["question"]
        assert ex.answer == rg["entry"]["answer"] and score(ex.answer, rg["entry"]) == 1.0
        assert 2 <= rg["entry"]["metadata"]["num_terms"] <= 3
        json.dumps(ex.meta)


def test_reasoning_gym_basic_arithmetic_and_errors():
    examples = load_examples("rg:basic_arithmetic?size=5&seed=3")
    assert len(examples) == 5 and all(ex.answer.lstrip("-").isdigit() for ex in examples)
    with pytest.raises(DataError, match=r"unknown reasoning-gym task \(did you mean chain_sum"):
        load_examples("rg:chain_summ")
    with pytest.raises(DataError, match=r"unknown option 'terms'; allowed: min_terms, .*size"):
        load_examples("rg:chain_sum?terms=3")
    with pytest.raises(DataError, match=r"rg:boxnet row 0: missing field 'answer'"):
        load_examples("rg:boxnet?size=1")  # judged by rules only: no reference answer


DEMO_LIKE = "rg:chain_sum?min_terms=2&max_terms=3&min_digits=1&max_digits=1&seed=1"


def test_reasoning_gym_prompts_are_distinct_by_default():
    """4000 plain draws of this task hold only ~1800 distinct prompts ("5 - 2 =" many times);
    distinct loading draws on until it has 4000 different ones, and says so when it cannot."""
    repeated = load_examples(DEMO_LIKE + "&size=4000&distinct=false")
    assert len(repeated) == 4000 and len({ex.prompt for ex in repeated}) < 2000
    distinct = load_examples(DEMO_LIKE + "&size=4000")
    assert len(distinct) == 4000 and len({ex.prompt for ex in distinct}) == 4000
    first_ids = {ex.id: ex.prompt for ex in repeated}
    assert all(first_ids.get(ex.id, ex.prompt) == ex.prompt for ex in distinct)  # ids keep the generator index
    two_terms = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=300"
    with pytest.raises(DataError, match=r"rg:chain_sum: asked for 300 distinct prompts, but \d+ draws gave only 200 "
                                        r".*Ask for fewer \(size=200\)"):
        load_examples(two_terms)  # a + b and a - b with one-digit terms: 200 problems in all


def test_fresh_items_exclude_known_prompts_instead_of_another_seed():
    known = load_examples(DEMO_LIKE + "&size=500")
    # another seed is mostly the same items, shifted by one
    shifted = load_examples(DEMO_LIKE.replace("seed=1", "seed=2") + "&size=500")
    assert len({ex.prompt for ex in known} & {ex.prompt for ex in shifted}) > 400
    keys = {prompt_key(ex.prompt) for ex in known}
    fresh = load_examples(DEMO_LIKE + "&size=300", exclude=keys)
    assert len(fresh) == 300 and not {prompt_key(ex.prompt) for ex in fresh} & keys
    table = load_examples("champ", exclude={prompt_key(ex.prompt) for ex in load_examples("champ?limit=20")})
    assert len(table) == 250


def test_fresh_items_come_after_more_excluded_prompts_than_the_stall_limit():
    """The demo's 4000 prompts fill the generator's first 4000+ draws: drawing past them is
    progress, not a stalled generator."""
    from selfopd.config import DEMO_DATA

    keys = {prompt_key(ex.prompt) for ex in load_examples(DEMO_DATA)}
    assert len(keys) == 4000
    fresh = load_examples(DEMO_DATA.replace("size=4000", "size=400"), exclude=keys)
    assert len(fresh) == 400 and not {prompt_key(ex.prompt) for ex in fresh} & keys


def test_a_run_records_its_split_and_finds_overlaps(tmp_path):
    examples = make_examples([f"question {i % 30}" for i in range(60)])
    train, evals = split_examples(examples, eval_size=5, seed=0)
    record = SplitRecord.of("spec", 0, train, evals)
    record.write(tmp_path)
    again = SplitRecord.read(tmp_path)
    assert again == record and len(again.eval_ids) == 5 and len(again.train_prompts) == 25
    assert trained_on(evals, again.train_prompts) == []
    assert len(trained_on(examples, again.train_prompts)) == 50  # every copy of the 25 training prompts
    other = SplitRecord.of("spec", 1, *split_examples(examples, eval_size=5, seed=1))
    with pytest.raises(DataError, match=r"run-x: the data now gives another split than the run recorded \(\d+ held-out"):
        record.check_same(other, "run-x")


def test_reasoning_gym_worked_solution_when_the_task_has_one():
    example = load_examples("rg:gsm_symbolic?size=2&seed=0")[0]
    assert example.solution.rstrip().endswith(f"#### {example.answer}")


# --------------------------------------------------------------------------- CHAMP


def test_champ_has_answers_solutions_and_hints():
    examples = load_examples("champ")
    assert len(examples) == 270 and len({ex.id for ex in examples}) == 270
    assert all(ex.answer and ex.solution for ex in examples)
    assert sum(bool(ex.hints) for ex in examples) == 245  # 25 problems come with concepts only
    first = examples[0]
    assert first.id == "P_Combinatorics_1" and first.answer == "239"
    assert first.solution.count("\n") == 5  # six steps, one per line
    assert first.hints[1] == "What are x_1, y_1, z_1?"
    with_concepts = load_examples("champ?concepts=true&limit=1")[0]
    assert with_concepts.hints == (first.meta["concepts"][0],) + first.hints
    assert with_concepts.hints[0].startswith("rule of sum: ")


# --------------------------------------------------------------------------- splitting


def make_examples(prompts):
    return [Example(id=f"e{i}", prompt=p, answer="0") for i, p in enumerate(prompts)]


def test_split_is_deterministic_disjoint_and_complete():
    examples = make_examples([f"question {i}" for i in range(100)])
    train, evals = split_examples(examples, eval_size=20, seed=1)
    assert len(evals) == 20 and len(train) == 80
    assert {ex.id for ex in train}.isdisjoint(ex.id for ex in evals)
    assert sorted(ex.id for ex in train + evals) == sorted(ex.id for ex in examples)
    assert train == [ex for ex in examples if ex in train]  # input order kept
    assert split_examples(examples, eval_size=20, seed=1) == (train, evals)
    assert split_examples(examples, eval_size=20, seed=2)[1] != evals
    assert len(split_examples(examples, eval_fraction=0.25, seed=1)[1]) == 25


def test_split_is_the_same_in_another_process():
    examples = make_examples([f"question {i}" for i in range(50)])
    ids_here = [ex.id for ex in split_examples(examples, eval_size=10, seed=5)[1]]
    code = ("from selfopd.data.split import split_examples\nfrom selfopd.data.example import Example\n"
            "ex = [Example(id=f'e{i}', prompt=f'question {i}', answer='0') for i in range(50)]\n"
            "print(','.join(e.id for e in split_examples(ex, eval_size=10, seed=5)[1]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert out.strip().split(",") == ids_here


def test_split_holds_each_eval_prompt_once_and_never_trains_on_it():
    examples = make_examples([f"question {i % 10}" for i in range(40)])  # each prompt 4 times
    for seed in range(5):
        train, evals = split_examples(examples, eval_size=2, seed=seed)
        assert {ex.prompt for ex in train}.isdisjoint(ex.prompt for ex in evals)
        assert len(evals) == 2 and len({ex.prompt for ex in evals}) == 2  # eval_size counts distinct prompts
        assert len(train) == 32  # the other 8 prompts, duplicates kept; the eval prompts' copies dropped
    with pytest.raises(DataError, match=r"eval_size must be in \[0, 10\] \(the data holds 10 distinct prompts in 40"):
        split_examples(examples, eval_size=11)
    by_id = split_examples(examples, eval_size=8, seed=0, by="id")
    assert len(by_id[1]) == 8 and {ex.prompt for ex in by_id[0]} & {ex.prompt for ex in by_id[1]}


def test_split_errors():
    examples = make_examples(["a", "b", "c"])
    with pytest.raises(DataError, match="exactly one of"):
        split_examples(examples, eval_size=1, eval_fraction=0.5)
    with pytest.raises(DataError, match=r"eval_size must be in \[0, 3\]"):
        split_examples(examples, eval_size=4)
    dup = examples + [Example(id="e1", prompt="d", answer="0")]
    with pytest.raises(DataError, match="duplicate id 'e1' at rows 1 and 3"):
        split_examples(dup, eval_size=1)
