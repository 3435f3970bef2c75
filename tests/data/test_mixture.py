"""Several tasks in one run (`selfopd.data.mixture`): loading, the split task by task, an equal
share of each step's prompts per task, each task's eval accuracy, and a training run on one."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from selfopd.data import DataError, load_examples
from selfopd.data.example import prompt_key
from selfopd.data.mixture import by_task, task_of
from selfopd.data.split import split_examples
from selfopd.training.rollout_pipeline import batch_for_step

KB = "kb:countries?entities=2&unseen=1"
SUMS = ("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+&allow_negation=false"
        "&allow_parentheses=false&size=40&seed=1")
MIXED = f"{KB} + {SUMS}"


def test_a_mixture_is_its_parts_in_order_each_tagged_with_its_task():
    mixed, kb, sums = load_examples(MIXED), load_examples(KB), load_examples(SUMS)
    assert [e.id for e in mixed] == [e.id for e in kb + sums]
    assert list(by_task(mixed)) == ["kb:countries", "rg:basic_arithmetic"]
    assert [task_of(e) for e in mixed] == ["kb:countries"] * len(kb) + ["rg:basic_arithmetic"] * len(sums)
    assert task_of(kb[0]) == ""  # a plain spec's items belong to no mixture


@pytest.mark.parametrize("spec,message", [
    (f"{KB} + {KB}", "two parts are task 'kb:countries'"),
    (f"{KB} + ", "a spec on each side"),
])
def test_a_bad_mixture_names_the_problem(spec, message):
    with pytest.raises(DataError, match=message):
        load_examples(spec)


def test_each_task_is_split_on_its_own_and_the_knowledge_task_keeps_its_held_out_phrasings():
    mixed = load_examples(MIXED)
    train, held = split_examples(mixed, eval_size=4, seed=0)
    assert Counter(task_of(e) for e in held) == {"kb:countries": 4, "rg:basic_arithmetic": 4}
    assert all(e.meta["split"] == "eval" for e in held if task_of(e) == "kb:countries")
    assert all(e.meta["split"] == "train" for e in train if task_of(e) == "kb:countries")
    assert not {prompt_key(e.prompt) for e in held} & {prompt_key(e.prompt) for e in train}
    alone_train, alone_held = split_examples(load_examples(SUMS), eval_size=4, seed=0)
    assert [e.id for e in held if task_of(e) == "rg:basic_arithmetic"] == [e.id for e in alone_held]
    _, capped = split_examples(mixed, eval_size=30, seed=0)  # the knowledge task holds out its own 16, arithmetic 30
    assert Counter(task_of(e) for e in capped) == {"kb:countries": 16, "rg:basic_arithmetic": 30}
    with pytest.raises(DataError, match="task rg:basic_arithmetic"):
        split_examples(mixed, eval_size=41, seed=0)  # more than arithmetic's 40 prompts


def test_every_step_takes_an_equal_share_of_each_task_and_cycles_each_on_its_own():
    train, _ = split_examples(load_examples(MIXED), eval_size=4, seed=0)
    kb_train = len(by_task(train)["kb:countries"])
    steps = [batch_for_step(train, step, 8, seed=3) for step in range(kb_train // 4 * 2)]
    assert all(Counter(task_of(e) for e in batch) == {"kb:countries": 4, "rg:basic_arithmetic": 4} for batch in steps)
    first_epoch = [e.id for batch in steps[: kb_train // 4] for e in batch if task_of(e) == "kb:countries"]
    assert sorted(first_epoch) == sorted(e.id for e in by_task(train)["kb:countries"])  # each item once per epoch
    assert batch_for_step(train, 5, 8, seed=3) == steps[5]  # a function of (seed, step): a resumed run sees the same


def test_a_mixtures_eval_reports_each_task(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfopd.engines.local import LocalEngine
    from selfopd.run.evaluate import evaluate
    from selfopd.templating.templates import load_template
    from selfopd.training.outputs import eval_metrics

    _, held = split_examples(load_examples(MIXED), eval_size=3, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    evaluate(LocalEngine(model, tokenizer), tokenizer, held, load_template("student/plain"), 4, 8, out_dir=tmp_path,
             progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    task = {e.id: task_of(e) for e in held}
    for name in ("kb:countries", "rg:basic_arithmetic"):
        mine = [r for r in records if task[r["id"]] == name]
        assert summary["by_task"][name]["n"] == 3
        assert summary["by_task"][name]["accuracy"] == sum(r["correct"] for r in mine) / 3
    metrics = eval_metrics(0, tmp_path)
    assert metrics["eval/n/kb:countries"] == 3 and "eval/accuracy/rg:basic_arithmetic" in metrics


def test_a_run_trains_on_a_mixture_with_one_teacher_template_per_task(tmp_path, tiny_model_dir):
    from selfopd.config import ConfigError, load_config
    from selfopd.training.trainer import build_run, train_step

    sets = [f"data.spec={MIXED}", "data.eval_size=2", f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
            "teacher.template=teacher/fact_sheet_or_answer_note", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_tokens=4", "optim.micro_batch_prompts=1", "eval.max_tokens=4",
            "run.progress=false", "run.rollouts_to_save=4"]
    run = build_run(load_config(None, [*sets, "run.name=mixed"]))
    train_step(run)
    rollouts = [json.loads(line) for line in (tmp_path / "mixed" / "rollouts" / "step_00001.jsonl").read_text().splitlines()]
    task = {e.id: task_of(e) for e in load_examples(MIXED)}
    assert Counter(task[r["id"]] for r in rollouts) == {"kb:countries": 2, "rg:basic_arithmetic": 2}
    run.close()
    with pytest.raises(ConfigError, match="multiple of the 2 tasks"):
        build_run(load_config(None, [*sets, "run.name=odd", "rollout.prompts_per_step=3"]))
