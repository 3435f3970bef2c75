"""The time-to-accuracy benchmark's arithmetic, on hand-made runs: curves, the time to the target,
intervals over seeds and the ratio to TRL paired by seed; its training rows are selfopd's; a kept run
resumes only under the same steps and eval spacing."""

from __future__ import annotations

import math

import pytest

from experiments.benchmarks.cpu_load import prompt_digest
from experiments.benchmarks.time_to_accuracy import (curve, finished_run, keep_run, ratio_interval, summarise, t_interval,
                                                      time_to, training_rows)


def run(step_seconds: list[float], evals: dict[int, float], trl: bool = False) -> dict:
    phases = {"generate": 1.0, "backward": 2.0} if trl else {"sample": 1.0, "train": 1.5, "teacher": 0.0}
    return {"steps": [{"step": i + 1, "wall_s": s, "phases": phases} for i, s in enumerate(step_seconds)],
            "evals": evals, "process_s": sum(step_seconds) + 30}


def test_curves_times_and_the_paired_ratio_by_hand():
    fast = run([10, 10, 10, 10], {2: 0.3, 4: 0.5})
    assert curve(fast, base=0.05) == [(0, 0.0, 0.05), (2, 20.0, 0.3), (4, 40.0, 0.5)]
    assert time_to(curve(fast, 0.05), 0.4) == 40.0 and time_to(curve(fast, 0.05), 0.6) is None
    # Seeds: selfopd reaches 0.4 at 40, 20, 60 s; TRL at 80, 40, 60 s -> ratios 0.5, 0.5, 1.0.
    ours = [run([10] * 4, {2: 0.3, 4: 0.5}), run([10] * 4, {2: 0.45, 4: 0.5}), run([15] * 4, {2: 0.2, 4: 0.41})]
    theirs = [run([20] * 4, {2: 0.1, 4: 0.4}, True), run([20] * 4, {2: 0.4, 4: 0.6}, True),
              run([15] * 4, {2: 0.3, 4: 0.45}, True)]
    summary = summarise({"trl": theirs, "selfopd": ours}, [0, 1, 2], base=0.05, target=0.4)
    assert summary["time_to_target_s"] == {"trl": [80.0, 40.0, 60.0], "selfopd": [40.0, 20.0, 60.0]}
    logs = [math.log(0.5), math.log(0.5), 0.0]
    mean, sd = sum(logs) / 3, math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    ratio = summary["ratio_to_trl"]["selfopd"]
    assert ratio["ratio"] == pytest.approx(math.exp(mean)) and ratio["per_seed"] == [0.5, 0.5, 1.0]
    assert (ratio["low"], ratio["high"]) == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert summary["time_to_target"]["selfopd"]["mean"] == pytest.approx(40.0)
    assert summary["final_accuracy"]["trl"]["mean"] == pytest.approx((0.4 + 0.6 + 0.45) / 3)
    differences = [0.5 - 0.4, 0.5 - 0.6, 0.41 - 0.45]  # selfopd minus TRL at the last eval, seed by seed
    spread = math.sqrt(sum((d - sum(differences) / 3) ** 2 for d in differences) / 2) * 4.302652729911275 / math.sqrt(3)
    difference = summary["final_accuracy_minus_trl"]["selfopd"]
    assert difference["mean"] == pytest.approx(sum(differences) / 3)
    assert difference["high"] - difference["mean"] == pytest.approx(spread)
    # Phase groups of the same work, after each process's first step.
    assert summary["phases_s"]["selfopd"]["sampling"] == 1.0 and summary["phases_s"]["trl"]["forward, backward"] == 2.0
    # A seed that never reaches the target leaves no mean and no ratio.
    never = summarise({"trl": theirs, "selfopd": ours[:2] + [run([10] * 4, {2: 0.1, 4: 0.2})]}, [0, 1, 2], 0.05, 0.4)
    assert never["time_to_target"]["selfopd"] is None and "selfopd" not in never["ratio_to_trl"]
    assert t_interval([1.0]) is None and ratio_interval([1.0], [2.0]) is None


def test_the_training_rows_are_the_prompts_selfopd_trains_on():
    from transformers import AutoTokenizer

    from selfopd.config import load_config
    from selfopd.core.models import resolve_model
    from selfopd.data.split import load_split
    from selfopd.templating.templates import load_template, prompt_token_ids, render_student
    from selfopd.training.rollout_pipeline import batch_for_step

    rows, digests = training_rows(seed=1, steps=2)
    config = load_config("experiments/demo/demo.toml", ["run.seed=1"])
    train, held_out = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    second = batch_for_step(train, 1, 8, 1)
    assert [r["answer"] for r in rows[8:]] == [e.answer for e in second]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.student))
    assert digests[1] == prompt_digest([prompt_token_ids(tokenizer, r["messages"]) for r in rows[8:]])
    template = load_template(config.data.student_template)
    held_out_messages = [render_student(template, e) for e in held_out]
    assert rows[0]["messages"] == render_student(template, batch_for_step(train, 0, 8, 1)[0])
    assert not any(r["messages"] in held_out_messages for r in rows)  # none of them held out


def test_a_kept_run_comes_back_whole_and_only_for_the_same_schedule(tmp_path):
    import argparse

    asked = argparse.Namespace(steps=24, eval_every=3)
    assert finished_run(tmp_path, "selfopd", 0, asked) is None
    kept = run([10, 12, 11], {3: 0.25})
    keep_run(tmp_path, "selfopd", 0, asked, kept)
    back = finished_run(tmp_path, "selfopd", 0, asked)
    assert back["steps"] == kept["steps"] and back["evals"] == {3: 0.25} and back["process_s"] == kept["process_s"]
    assert back == kept  # the same fields as a fresh run: the schedule is checked, not carried into the report
    assert finished_run(tmp_path, "selfopd", 1, asked) is None and finished_run(tmp_path, "trl", 0, asked) is None
    with pytest.raises(SystemExit, match="selfopd-seed0.result.json: kept for 24 steps, eval every 3"):
        finished_run(tmp_path, "selfopd", 0, argparse.Namespace(steps=12, eval_every=3))
