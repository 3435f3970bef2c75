"""The illusion guard (`selfopd.training.guard`): each condition fires at its boundary and not below
it, only at its onset, on the window's pooled teacher-prefers-correct measure (checked
against a float64 brute force); offline replay of saved rollouts equals the live metrics;
a tiny-model run warns or stops, keeps the checkpoint, and `--resume` goes on. The real-run
evidence (SmolLM2) replays committed metrics of real runs: tests/data/guard/."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from selfopd.cli import main
from selfopd.config import ConfigError, GuardConfig, load_config
from selfopd.run.rollouts import RolloutRecord, write_records
from selfopd.training.guard import FIRED, check, events, replay, training_lines
from selfopd.training.loss_metrics import preference_metrics
from selfopd.core.run_folder import RunFolder

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data" / "guard"
# Thresholds that are exact in binary floating point, so the boundaries are exact too.
GUARD = GuardConfig(window=4, kl_drop=0.25, accuracy_drop=0.125, truncated_share=0.5, truncated_rise=0.125,
                    truncated_z=0.0, preference_max=0.0, preference_groups=4)  # the length cap's noise test: below
PROMPTS = 8  # rollout.prompts_per_step of the runs here (the demo's)
QUIET = {"opd/reverse_kl": 1.0, "reward/accuracy": 0.5, "rollout/truncated_share": 0.25,
         "opd/correct_preference_groups": 0.0, "opd/correct_preference_sum": 0.0, "opd/correct_preference_sumsq": 0.0}


def _history(*changes: dict, before: int = 2) -> list[dict]:
    """`before` quiet steps, then one step per dict of changed fields (steps numbered from 1)."""
    rows = [dict(QUIET)] * before + [{**QUIET, **change} for change in changes]
    return [{"step": step, **row} for step, row in enumerate(rows, start=1)]


def _conditions(history: list[dict], guard: GuardConfig = GUARD) -> list[str]:
    return [event.condition for event in check(history, guard, PROMPTS)]


def test_kl_and_accuracy_falling_together_fires_at_the_margins_and_not_below():
    at_margin = {"opd/reverse_kl": 0.75, "reward/accuracy": 0.375}
    assert _conditions(_history(at_margin, at_margin)) == ["kl_and_accuracy_fall"]
    assert _conditions(_history(at_margin, {**at_margin, "reward/accuracy": 0.5})) == []  # accuracy fell too little
    assert _conditions(_history(at_margin, {**at_margin, "opd/reverse_kl": 1.0})) == []  # the KL fell too little
    assert _conditions(_history({"opd/reverse_kl": 0.5}, {"opd/reverse_kl": 0.5})) == []  # KL falls, accuracy holds
    event = check(_history(at_margin, at_margin), GUARD, PROMPTS)[0]
    assert event.step == 4 and event.numbers == {"kl_first_half": 1.0, "kl_second_half": 0.75,
                                                  "accuracy_first_half": 0.5, "accuracy_second_half": 0.375}


def test_the_length_cap_fires_on_a_high_rising_share_not_on_a_high_falling_one():
    rising = {"rollout/truncated_share": 0.5}
    assert _conditions(_history(rising, rising)) == ["length_cap"]  # 0.25 -> 0.5: high enough, risen 0.25
    assert _conditions(_history({"rollout/truncated_share": 0.375}, {"rollout/truncated_share": 0.375})) == []
    high_falling = [{"rollout/truncated_share": share} for share in (0.875, 0.875, 0.75, 0.625)]
    assert _conditions(_history(*high_falling, before=0)) == []  # a base model that explains too much, improving
    high_flat = [{"rollout/truncated_share": 0.75}] * 4
    assert _conditions(_history(*high_flat, before=0)) == []  # high but not rising


def _preference_step(contrasts: list[float]) -> dict:
    return {"opd/correct_preference_groups": float(len(contrasts)), "opd/correct_preference_sum": sum(contrasts),
            "opd/correct_preference_sumsq": sum(c * c for c in contrasts)}


def test_teacher_prefers_wrong_pools_the_window_and_matches_a_float64_brute_force():
    rng = random.Random(0)
    per_step = [[rng.gauss(-0.3, 0.4) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    history = [{"step": i + 1, **QUIET, **_preference_step(c)} for i, c in enumerate(per_step)]
    pooled = np.array([c for step in per_step for c in step], dtype=np.float64)
    high = pooled.mean() + 1.959963984540054 * pooled.std(ddof=1) / np.sqrt(len(pooled))
    assert high < 0
    fired = check(history, GUARD, PROMPTS)
    assert [e.condition for e in fired] == ["teacher_prefers_wrong"]
    assert fired[0].numbers["preference"] == pytest.approx(pooled.mean(), abs=1e-12)
    assert fired[0].numbers["preference_high"] == pytest.approx(high, abs=1e-12)
    assert fired[0].numbers["groups"] == len(pooled)
    # The bound itself is the boundary: a threshold just below it does not fire.
    assert _conditions(history, replace(GUARD, preference_max=high - 1e-9)) == []
    # Too few prompt groups: no verdict, however negative.
    assert _conditions(history, replace(GUARD, preference_groups=len(pooled) + 1)) == []
    # A step that does not report the sums (no verdict rather than a verdict on part of the window).
    assert _conditions([*history[:-1], {**history[-1], "opd/correct_preference_sum": None}]) == []


def test_preference_metrics_match_a_brute_force_per_group():
    rng = random.Random(1)
    rollouts = [(group, rng.random() < 0.4, rng.gauss(0, 1)) for group in range(6) for _ in range(4)]
    contrasts = []
    for group in range(6):
        right = [s for g, c, s in rollouts if g == group and c]
        wrong = [s for g, c, s in rollouts if g == group and not c]
        if right and wrong:
            contrasts.append(np.mean(right) - np.mean(wrong))
    metrics = preference_metrics(rollouts)
    assert metrics["opd/correct_preference_groups"] == len(contrasts) > 0
    assert metrics["opd/correct_preference"] == pytest.approx(np.mean(contrasts), abs=1e-12)
    assert metrics["opd/correct_preference_sumsq"] == pytest.approx(np.sum(np.square(contrasts)), abs=1e-12)
    assert preference_metrics([(0, True, 1.0), (1, False, 0.0)]) == {  # no group with both outcomes
        "opd/correct_preference_groups": 0.0, "opd/correct_preference_sum": 0.0, "opd/correct_preference_sumsq": 0.0}


def test_the_length_cap_fires_on_a_rise_out_of_the_noise_of_its_prompts_only():
    """Defaults (window 6: 3 steps of 8 prompts a half, 24 units). A learning knowledge-task run
    (frozen fact-sheet teacher, held out 1/64 -> 8/64) hovered at 0.55-0.66 cut off and fired on
    that noise; a collapsing one (self teacher) rose 0.32 -> 0.60."""
    def shares(first: float, second: float) -> list[dict]:
        return _history(*[{"rollout/truncated_share": first}] * 3, *[{"rollout/truncated_share": second}] * 3, before=0)

    assert [e.condition for e in check(shares(0.55, 0.66), GuardConfig(), PROMPTS)] == []
    assert [e.condition for e in check(shares(0.55, 0.66), GuardConfig(truncated_z=0), PROMPTS)] == ["length_cap"]
    event = check(shares(0.32, 0.60), GuardConfig(), PROMPTS)[0]
    pooled = (0.32 + 0.60) / 2  # by hand: the difference over the standard error of two shares of 24 prompts
    assert event.numbers["rise_z"] == pytest.approx(0.28 / (pooled * (1 - pooled) * 2 / 24) ** 0.5)
    assert "1.9 standard errors over 24 prompts" in event.reason
    assert check(shares(0.32, 0.60), GuardConfig(), prompts_per_step=2) == []  # 6 prompts a half: within the noise


def test_a_condition_fires_at_its_onset_only_and_again_after_it_ended():
    high = {"rollout/truncated_share": 0.75}
    history = _history(high, high, high, high, {}, {}, {}, {}, high, high)
    fired = [(e.step, e.condition) for e in events(history, GUARD, PROMPTS)]
    assert fired == [(4, "length_cap"), (11, "length_cap")]
    # Deciding on a prefix (what a resumed run's truncated metrics.jsonl holds) gives the same events.
    assert [e for e in events(history[:7], GUARD, PROMPTS)] == [e for e in events(history, GUARD, PROMPTS) if e.step <= 7]


def test_guard_settings_are_checked_naming_the_key():
    with pytest.raises(ConfigError, match="guard.window: must be >= 2"):
        load_config(None, ["guard.window=1"])
    with pytest.raises(ConfigError, match="guard.action: must be one of"):
        load_config(None, ["guard.action=halt"])
    with pytest.raises(ConfigError, match=r"guard.truncated_share: must be in \[0, 1\]"):
        load_config(None, ["guard.truncated_share=1.5"])


def test_replay_takes_the_preference_from_saved_rollouts_when_the_metrics_predate_it(tmp_path):
    """A run made before the guard has no preference sums in its metrics: `replay` reads them
    off its saved rollouts, and decides as if the trainer had logged them."""
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir()
    folder.config.write_text("[guard]\nwindow = 2\npreference_groups = 2\n")
    rng = random.Random(2)
    lines = []
    for step in (1, 2):
        records = [RolloutRecord(step=step, id=f"p{group}", group=group, prompt_ids=[1, group], completion_ids=[5, 6],
                                 text="", sampler_logprobs=[0.0, 0.0], student_logprobs=[-1.0, -1.0],
                                 teacher_logprobs=[-1.0 + (-0.5 if correct else 0.5) + rng.gauss(0, 0.1), -1.0],
                                 advantage=[0.0, 0.0], reward=float(correct), correct=correct, answer="1")
                   for group in range(3) for correct in (True, False)]
        write_records(folder.rollouts_file(step), records)
        logged = preference_metrics((r.group, r.correct, sum(r.opd_advantage) / 2) for r in records)
        lines.append({"step": step, **QUIET, **logged})
    stripped = [{k: v for k, v in line.items() if not k.startswith("opd/correct_preference")} for line in lines]
    folder.metrics.write_text("".join(json.dumps(line) + "\n" for line in stripped))
    from_rollouts = replay(folder.root)
    assert [e.condition for e in from_rollouts] == ["teacher_prefers_wrong"]
    assert from_rollouts == events(lines, load_config(folder.config).guard, PROMPTS)


# --- real runs (SmolLM2-135M, the demo task), replayed from their committed metrics ------


def test_the_demo_recipe_runs_72_steps_without_a_false_alarm():
    """The demo's recipe (GRPO + 0.3 x answer-note OPD; held out +0.58 at step 24), its
    committed per-step KL, accuracy and length-cap share: neither the KL-and-accuracy nor
    the length-cap condition fires in any window, though its accuracy is noisy (0.03-0.84)
    and its cut-off share falls from 0.81 to 0."""
    per_step = json.loads((ROOT / "experiments" / "demo" / "results" / "demo_3x_summary.json").read_text())["per_step"]
    history = [{"step": i + 1, **{key: values[i] for key, values in per_step.items()}}
               for i in range(len(per_step["reward/accuracy"]))]
    assert len(history) == 72
    assert events(history, GuardConfig(), PROMPTS) == []
    # The check can fail: with half the margins (and a window of 8) noise alone fires it.
    assert events(history, GuardConfig(window=8, kl_drop=0.05, accuracy_drop=0.025), PROMPTS)


def _committed(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def test_a_self_teacher_shown_the_attempt_is_caught_where_it_did_harm():
    """The verifier-feedback self teacher (pure OPD, demo task, seed 0, 12 steps, trained with
    the guard on: tests/data/guard/verifier_feedback_seed0.jsonl, wall times dropped): the
    student ended below the base model. The run's guard (window 8) fired at step 8 on the
    teacher's preference for wrong attempts, then on the KL falling with accuracy; the default
    window of 6 fires at step 6 on both."""
    lines = _committed("verifier_feedback_seed0")
    evals = [line["eval/accuracy"] for line in lines if "eval/accuracy" in line]
    assert evals == [0.06, 0.01]  # held out, 200 distinct prompts: -0.050 [-0.083, -0.017]
    history = training_lines(lines)
    live = [(e.step, e.condition) for e in events(history, GuardConfig(window=8), PROMPTS)]  # the run's own setting
    assert live == [(8, "teacher_prefers_wrong"), (9, "kl_and_accuracy_fall")]
    # Trained before the length cap's noise test: it also fired at step 12 on 0.61 -> 0.73 cut off (1.0
    # standard errors over 32 prompts a half), which the test now leaves out; the rest is offline = live.
    logged = [(line["step"], c) for line in history for c in line.get(FIRED, [])]
    assert logged == [*live, (12, "length_cap")]
    assert [(e.step, e.condition) for e in events(history, GuardConfig(window=8, truncated_z=0), PROMPTS)] == logged
    fired = [(e.step, e.condition) for e in events(history, GuardConfig(), PROMPTS)]  # the default window of 6
    assert fired == [(6, "kl_and_accuracy_fall"), (6, "teacher_prefers_wrong"), (8, "kl_and_accuracy_fall")]


def test_the_answer_note_self_teacher_that_helped_raises_no_alarm():
    """The answer-note self teacher (same recipe and seed; the coordinator's comparison, its
    preference sums read off its saved rollouts): held out +0.175, and the guard stays
    silent over its 12 steps."""
    lines = _committed("answer_note_seed0")
    evals = [line["eval/accuracy"] for line in lines if "eval/accuracy" in line]
    assert evals[-1] - evals[0] == pytest.approx(0.175)
    assert events(training_lines(lines), GuardConfig(), PROMPTS) == []
    assert events(training_lines(lines), GuardConfig(window=8, preference_max=0.2), PROMPTS)  # it can fail: a higher bar fires


# --- the tiny model through the CLI -----------------------------------------------------

SMALL = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
         "optim.micro_batch_prompts=1", "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false",
         "run.eval_every=0", "run.steps=4",
         # On the tiny random model every answer is cut off at 6 tokens: a share that never falls
         # holds the length-cap condition with these thresholds from the first full window on.
         "guard.window=2", "guard.truncated_share=0", "guard.truncated_rise=0", "guard.truncated_z=0"]


def _train_argv(model: Path, out: Path, *sets: str) -> list[str]:
    pairs = [arg for s in (*SMALL, f"model.student={model}", f"run.out_dir={out}", "run.name=run", *sets)
             for arg in ("--set", s)]
    return ["train", str(ROOT / "experiments" / "demo" / "demo.toml"), *pairs]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_stopping_guard_checkpoints_says_why_and_resume_goes_on(tmp_path, tiny_model_dir, capsys):
    run = tmp_path / "run"
    assert main(_train_argv(tiny_model_dir, tmp_path, "guard.action=stop")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("selfopd: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("selfopd: error: the illusion guard stopped the run after step 2 (guard.action = "
                               "'stop'): length_cap: ")
    assert f"Checkpoint: {run / 'checkpoints' / 'step_00002'}" in lines[0]
    assert f"selfopd train --resume {run} --set guard.action=warn (or off)" in lines[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00002"]
    saved = json.loads((run / "guard.json").read_text())
    assert [(e["step"], e["condition"]) for e in saved] == [(2, "length_cap")]
    assert "step 2, `length_cap`" in (run / "guard.md").read_text()
    steps = [m for m in _metrics(run) if "opd/reverse_kl" in m]
    assert [(m["step"], m.get(FIRED)) for m in steps] == [(1, None), (2, ["length_cap"])]
    assert RunFolder(run).eval_steps() == [0, 2]  # the stopped step is evaluated: its held-out accuracy is known
    assert [(e.step, e.condition) for e in replay(run)] == [(2, "length_cap")]  # offline = live

    assert main(["train", "--resume", str(run), "--set", "guard.action=off"]) == 0
    steps = [m for m in _metrics(run) if "opd/reverse_kl" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00002", "step_00004"]


def test_a_warning_guard_goes_on_and_keeps_the_checkpoint_it_fired_at(tmp_path, tiny_model_dir, capsys):
    run = tmp_path / "run"
    assert main(_train_argv(tiny_model_dir, tmp_path)) == 0  # guard.action = "warn", the default
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfopd: guard: ")]
    assert len(warnings) == 1 and warnings[0].startswith("selfopd: guard: step 2: length_cap: "), warnings
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00002", "step_00004"]
    assert [m.get(FIRED) for m in _metrics(run) if "opd/reverse_kl" in m] == [None, ["length_cap"], None, None]


def test_the_guard_watches_only_a_trained_teacher_term(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    assert main(_train_argv(tiny_model_dir, tmp_path, "loss.lambda_opd=0", "loss.lambda_rl=1")) == 0
    assert not (run / "guard.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00004"]


def test_a_comparison_reports_an_arm_its_guard_stopped_and_runs_the_others(tmp_path, tiny_model_dir, capsys):
    shared = [s for s in SMALL if not s.startswith("run.")] + [
        f"model.student={tiny_model_dir}", "run.steps=4", "run.eval_every=0", "run.progress=false", "guard.action=stop"]
    path = tmp_path / "cmp.toml"
    path.write_text(f"""[compare]
name = "cmp"
out_dir = "{tmp_path / 'runs'}"
base = "{ROOT / 'experiments' / 'demo' / 'demo.toml'}"
set = {json.dumps(shared)}

[arms.opd]
set = ["loss.lambda_rl=0", "loss.lambda_opd=1"]

[arms.grpo]
set = ["loss.lambda_opd=0", "loss.lambda_rl=1"]
""")
    assert main(["compare", str(path)]) == 0
    assert "[1/2] arm opd, seed 0: the illusion guard stopped the run after step 2" in capsys.readouterr().out
    arms = tmp_path / "runs" / "cmp" / "arms"
    assert json.loads((arms / "opd" / "seed0" / "finished.json").read_text())["stopped_by_guard"] == 2
    assert "stopped_by_guard" not in json.loads((arms / "grpo" / "seed0" / "finished.json").read_text())
    report = (tmp_path / "runs" / "cmp" / "report.md").read_text()
    assert "| 2 (seed 0 stopped by the illusion guard) |" in report
    assert "| `grpo` |" in report and "| 4 |" in report
