"""experiments/knowledge/run.py: its arms build, its SFT runs are kept without weights and
restored without training again, and runs never start from weights other than the ones the
archived runs started from."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from selfopd.comparisons.compare import arm_configs, load_compare_config
from selfopd.comparisons.records import RecordArchive
from selfopd.data import load_examples

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(tmp_path, monkeypatch):
    module = importlib.import_module("experiments.knowledge.run")
    monkeypatch.setattr(module, "ARCHIVE", tmp_path / "knowledge_runs.tar.xz")
    monkeypatch.setattr(module, "START_RECORD", tmp_path / "knowledge_start.json")
    monkeypatch.setattr(module, "SEEDS", (0,))
    return module


def test_every_arm_builds_and_the_shuffled_control_asks_the_same_questions(runner):
    config = load_compare_config(runner.ARMS, ["model.student=smollm2-135m-instruct"])
    configs = arm_configs(config, sft_model=Path("sft_model"))
    assert len(configs) == 6 * 3
    assert {name for name, _ in configs} >= {runner.PRIMARY_OPD, *runner.OPD_ARMS, "grpo_only"}
    spec = configs["grpo_only", 0].data.spec
    own, shuffled = load_examples(spec), load_examples(f"{spec}&sheet=shuffled")
    assert [(e.id, e.prompt, e.answer) for e in own] == [(e.id, e.prompt, e.answer) for e in shuffled]
    assert all(a.meta["fact_sheet"] != b.meta["fact_sheet"] for a, b in zip(own, shuffled))


def test_sft_runs_are_kept_without_weights_and_restored_without_training_again(runner, tmp_path, monkeypatch):
    calls = []

    def fake_selfopd(*args: str) -> None:  # what each command leaves on disk
        calls.append(args[0])
        out = Path(args[args.index("--out") + 1]) if "--out" in args else None
        if args[0] == "sft":
            folder = Path(next(a for a in args if a.startswith("run.out_dir=")).split("=", 1)[1])
            run_dir = folder / next(a for a in args if a.startswith("sft.name=")).split("=", 1)[1]
            (run_dir / "model").mkdir(parents=True)
            (run_dir / "model" / "model.safetensors").write_bytes(b"weights")
            (run_dir / "summary.json").write_text('{"tuned": {"accuracy": 0.9}}')
        else:
            out.mkdir(parents=True)
            (out / "summary.json").write_text("{}")

    monkeypatch.setattr(runner, "selfopd", fake_selfopd)
    out = tmp_path / "runs"
    runner.sft(out, start=tmp_path / "start", spec="kb:countries?entities=8&unseen=4")
    assert calls == ["sft", "eval", "eval", "eval", "drift"] * 2
    archive = RecordArchive(runner.ARCHIVE, "sft")
    assert set(archive.names("sft_gold_seed0")) == {"summary.json", "retention/arithmetic/summary.json",
                                                     "retention/unseen/summary.json", "retention/fresh/summary.json",
                                                     "retention/drift/summary.json"}

    calls.clear()
    fresh = tmp_path / "new_checkout" / "runs"
    runner.sft(fresh, start=tmp_path / "start", spec="kb:countries?entities=8&unseen=4")
    assert calls == []
    assert json.loads((fresh / "sft" / "sft_teacher_seed0" / "summary.json").read_text())["tuned"]["accuracy"] == 0.9


def test_a_restored_run_without_weights_is_said_and_not_measured(runner, tmp_path, capsys):
    run_dir = tmp_path / "run"
    runner.retention(run_dir, None, tmp_path / "start", "kb:countries")
    assert capsys.readouterr().out.count("has no weights left") == 4
    assert not (run_dir / "retention").exists()


def test_a_start_model_other_than_the_archived_runs_one_stops_the_study(runner, tmp_path, monkeypatch):
    out = tmp_path / "runs"
    checkpoint = out / "start" / "checkpoints" / "step_00024"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"new weights")
    (out / "start" / "eval" / "step_00024").mkdir(parents=True)
    (out / "start" / "eval" / "step_00024" / "summary.json").write_text('{"accuracy": 0.6}')
    monkeypatch.setattr(runner.RunFolder, "latest_checkpoint", lambda self: checkpoint)
    monkeypatch.setattr(runner, "retention", lambda *args, **kwargs: None)
    runner.START_RECORD.write_text(json.dumps({"digest": runner.weights_digest(checkpoint)}))
    assert runner.start_model(out) == checkpoint
    runner.START_RECORD.write_text(json.dumps({"digest": "0" * 64}))
    with pytest.raises(SystemExit, match="knowledge_start.json"):
        runner.start_model(out)


def test_the_mixed_runs_hold_out_the_demos_own_sums_and_every_held_out_phrasing(runner, tmp_path):
    from collections import Counter

    from selfopd.config import load_config
    from selfopd.data.mixture import task_of
    from selfopd.data.split import load_split

    config = runner.mixed_grid(tmp_path, Path("smollm2-135m-instruct"), "kb:countries?entities=8&unseen=4")
    configs = arm_configs(config, sft_model=None)
    assert {name for name, _ in configs} == {"grpo_only", runner.PRIMARY_OPD}
    data = configs["grpo_only", 0].data
    train, held = load_split(data.spec, data.eval_size, data.split_seed)
    assert Counter(task_of(e) for e in held) == {"kb:countries": 64, "rg:basic_arithmetic": 200}
    demo = load_config(runner.DEMO).data
    demo_train, demo_held = load_split(demo.spec, demo.eval_size, demo.split_seed)
    assert [e.prompt for e in held if task_of(e) == "rg:basic_arithmetic"] == [e.prompt for e in demo_held]
    assert not {e.prompt for e in held} & {e.prompt for e in demo_train}  # the start model never trained on them


def test_the_report_says_what_has_not_run_yet(runner, tmp_path, monkeypatch):
    report = importlib.import_module("experiments.knowledge.report")
    monkeypatch.setattr(report.study, "ARCHIVE", runner.ARCHIVE)  # an empty archive: nothing to restore
    measured = report.measure(tmp_path / "runs")
    text = report.render(measured, None)
    assert text.count("not yet run") >= 11 and "## Verdicts" in text
    assert all(value is None for call in report.verdicts(measured["rows"]).values() for value in call.values())
    assert "Recipe: not decided until" in text


def _diagnosis(ratio=None, trained_low=0.1, warns=False):
    transfer = None if ratio is None else {"ratio": {"value": sum(ratio) / 2, "low": ratio[0], "high": ratio[1]},
                                           "trained": {"value": 0.2, "low": trained_low, "high": 0.3}}
    return {"transfer": transfer, "warning_last": warns}


def test_the_regimes_criterion_on_hand_cases():
    report = importlib.import_module("experiments.knowledge.report")
    note = report.ANSWER_NOTE
    learner = {"a": _diagnosis((0.7, 1.2), warns=True)}
    told = report.regimes_told_apart({**learner, note: _diagnosis((0.1, 0.4), warns=True)}, ["a"])
    assert told == {"learners": ["a"], "transfer": True, "lift": False}  # the lift warns on the learning arm too
    # the note closed no gap on its training prompts: its ratio is not read, and it does not count as transfer
    assert report.regimes_told_apart({**learner, note: _diagnosis((0.6, 2.0), trained_low=-0.1)}, ["a"])["transfer"]
    assert not report.regimes_told_apart({**learner, note: _diagnosis((0.3, 0.6))}, ["a"])["transfer"]  # crosses 0.5
    assert not report.regimes_told_apart({"a": _diagnosis((0.4, 1.2)), note: _diagnosis((0.1, 0.4))}, ["a"])["transfer"]
    assert report.regimes_told_apart({"a": _diagnosis(), note: _diagnosis(warns=True)}, ["a"]) == \
        {"learners": ["a"], "transfer": False, "lift": True}  # a learning arm without a transfer fails it
    assert report.regimes_told_apart(learner, ["a"]) is None  # the answer note has not run


def test_the_recipe_rule_on_hand_cases():
    from selfopd.core.stats import PairedDifference

    report = importlib.import_module("experiments.knowledge.report")

    def calls(**passing):
        return {name: {"beats_grpo": name in passing, "not_worse_than_sft_on_forgetting": passing.get(name, False)}
                for name in report.study.OPD_ARMS}

    def longer(arm, high):
        return {"arm": arm, "change": PairedDifference(high - 0.1, high - 0.2, high, 64, 3)}

    assert "No recipe" in report.recipe_call(calls(), None)
    assert "No recipe" in report.recipe_call(calls(external_sft=False), longer("external_sft", 0.1))
    assert "waits for the 3x" in report.recipe_call(calls(opd_topk=True), None)
    assert "Recipe: `opd_topk`" in report.recipe_call(calls(opd_topk=True), longer("opd_topk", 0.0))
    assert "No recipe" in report.recipe_call(calls(opd_topk=True), longer("opd_topk", -0.01))  # lower at 3x
    undecided = {**calls(), "opd_topk": {"beats_grpo": True, "not_worse_than_sft_on_forgetting": None}}
    assert "not decided until opd_topk" in report.recipe_call(undecided, None)


def test_the_study_time_on_a_hand_made_timing_file(tmp_path):
    report = importlib.import_module("experiments.knowledge.report")
    rows = [("grpo_only seed 0", 400, 1000), ("opd_sampled seed 0", 500, 1650),  # 150 s of measures after the first
            ("opd_topk seed 0", 300, 5000), ("sft", 0.001, 5001)]  # 3050 s: an interruption, not a measure
    (tmp_path / "knowledge").mkdir()
    (tmp_path / "knowledge" / "timing.jsonl").write_text(
        "".join(json.dumps({"what": w, "wall_seconds": s, "finished_at": t}) + "\n" for w, s, t in rows))
    (tmp_path / "sft" / "sft_gold_seed0").mkdir(parents=True)
    (tmp_path / "sft" / "sft_gold_seed0" / "summary.json").write_text(json.dumps({"seconds": {"total": 300.0}}))
    stages = report.study_time(tmp_path)
    assert stages["grid"] == {"runs": 3, "seconds": [400, 500, 300], "measures": [150]}
    assert stages["sft"]["seconds"] == [300.0] and stages["mixed"]["runs"] == 0
    text = "\n".join(report._time_lines(stages))
    assert "| grid | 3 | 0.33 h | 6.7 min | 0.46 h |" in text  # 3 x (400 + 150) s
    assert "**0.6 h**" in text  # + (300 + 150) s of SFT


def test_amendment_5s_reading_on_hand_cases(tmp_path):
    report = importlib.import_module("experiments.knowledge.report")
    from selfopd.diagnostics.transfer import AnswerLogprobs, write_transfer_rows

    def rows(gaps, gains):
        return [AnswerLogprobs(f"p{i}", -5.0 + gap, -5.0, -5.0 + gain) for i, (gap, gain) in enumerate(zip(gaps, gains))]

    path = tmp_path / "transfer.jsonl"  # the 0.1-nat gaps leave the measure at ln 2: only the 2-nat ones count
    write_transfer_rows((rows([2.0, 2.0, 0.1], [1.0, 1.2, 0.5]), rows([2.0, 2.0, 0.1], [0.9, 1.1, 0.6])), path)
    doubled = report.transfer_at_least_doubled(path)
    assert doubled["trained"]["n"] == 2 and doubled["held_out"]["value"] == pytest.approx(2.0 / 4.0)
    assert doubled["ratio"]["value"] == pytest.approx((2.0 / 4.0) / (2.2 / 4.0))
    write_transfer_rows((rows([0.1], [0.5]), rows([2.0], [1.0])), path)
    assert "nothing to transfer" in report.transfer_at_least_doubled(path)["not_measured"]
    assert report.transfer_at_least_doubled(tmp_path / "absent.jsonl") is None

    learns = {"transfer_doubling": {"ratio": {"low": 0.8, "high": 1.2}, "trained": {"low": 0.2}}}
    wrong = {"transfer_doubling": {"not_measured": "no prompt ...: nothing to transfer"}}
    lines = report.doubling_line({"external_sft": learns, report.ANSWER_NOTE: wrong, "shuffled": wrong})
    assert "credits `external_sft`, does not credit the answer note" in lines[1] and lines[1].endswith("**yes**.")
    assert report.doubling_line({"external_sft": learns, report.ANSWER_NOTE: wrong, "shuffled": learns})[1].endswith("**no**.")
    assert report.doubling_line({"external_sft": learns, report.ANSWER_NOTE: wrong}) == []  # a diagnosis missing
