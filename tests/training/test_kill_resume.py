"""`kill -9` at exact moments (`selfopd.core.faults`), then a rerun: training, comparisons and SFT
continue from their last complete checkpoint and end exactly where an uninterrupted run ends.

Every run is the real CLI in a subprocess that SIGKILLs itself at a named fault point; the
metrics of each resumed run are compared, bit for bit (wall times aside), with those of one
uninterrupted run of the same config, and metrics.jsonl is read back strictly: every line
whole, none repeated.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfopd.core.atomic import replace_atomic, write_json_atomic
from selfopd.run.tracking import metrics_key
from selfopd.run.tracking import untimed

pytestmark = pytest.mark.slow  # minutes of real processes: the whole suite only (make test)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
    "run.progress=false", "run.steps=4", "run.eval_every=2", "run.checkpoint_every=2", "model.threads=1",
]
KILLED = -signal.SIGKILL


def _sets(settings: list[str]) -> list[str]:
    return [part for setting in settings for part in ("--set", setting)]


def _cli(args: list[str], kill_at: str = "", timeout: int = 300, sends: str = "SIGKILL") -> subprocess.CompletedProcess:
    """`python -m selfopd ARGS` in a fresh process, sent `sends` (SIGKILL) at `kill_at` when given."""
    env = {**os.environ, "SELFOPD_KILL_AT": kill_at, "SELFOPD_KILL_SIGNAL": sends}
    return subprocess.run([sys.executable, "-m", "selfopd", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def _killed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == KILLED, f"not killed (rc {result.returncode}): {result.stderr[-3000:]}"


def _train(run_dir: Path, model: Path, kill_at: str = "", extra: tuple[str, ...] = (),
           sends: str = "SIGKILL") -> subprocess.CompletedProcess:
    sets = [*TRAIN, f"model.student={model}", f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", *extra]
    return _cli(["train", str(ROOT / "experiments" / "demo" / "demo.toml"), *_sets(sets)], kill_at, sends=sends)


def _resume(run_dir: Path, kill_at: str = "") -> subprocess.CompletedProcess:
    return _cli(["train", "--resume", str(run_dir)], kill_at)


def _metrics(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl, parsed strictly (a torn line fails), wall times dropped;
    each (step, kind) at most once."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]
    keys = [metrics_key(line) for line in lines]
    assert len(keys) == len(set(keys)), f"repeated lines: {keys}"
    return [untimed(line) for line in lines]


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_json_atomic(tmp_path / "summary.json", {"accuracy": 0.5})

    def fail(temporary: Path) -> None:
        temporary.write_text('{"accura')
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        replace_atomic(path, fail)
    assert json.loads(path.read_text()) == {"accuracy": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> list[dict]:
    """The metrics of one uninterrupted tiny-model run: what every killed run must end with."""
    run_dir = tmp_path_factory.mktemp("reference") / "whole"
    _ok(_train(run_dir, tiny_model_dir))
    return _metrics(run_dir)


@pytest.mark.parametrize("kill_at", [
    "train.sampled:3",       # step 3: the engine returned its rollouts, nothing trained yet
    "train.backward:5",      # step 3: after the first micro-batch's backward, before the second
    "checkpoint.weights:2",  # step 4's checkpoint: weights written, trainer_state not yet
    "checkpoint.renamed:2",  # step 4's checkpoint in place, step 2's not yet deleted
    "metrics.logged:5",      # step 3's metrics line written, nothing after it (then a torn line added)
    "eval.written:3",        # step 4's eval: eval.jsonl written, summary.json not yet
])
def test_a_run_killed_at_any_moment_resumes_to_the_same_metrics(tmp_path, tiny_model_dir, reference, kill_at):
    run_dir = tmp_path / "run"
    _killed(_train(run_dir, tiny_model_dir, kill_at))
    if kill_at.startswith("metrics."):  # what a kill inside the write of a line leaves (an OS crash can)
        with (run_dir / "metrics.jsonl").open("a") as handle:
            handle.write('{"step": 4, "loss/pg": 0.12')
    _ok(_resume(run_dir))
    assert _metrics(run_dir) == reference
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00004"]  # no stale or partial one


@pytest.mark.parametrize("sends", ["SIGTERM", "SIGUSR1"])
def test_a_signal_mid_step_checkpoints_that_step_and_the_resumed_run_goes_on_exactly(tmp_path, tiny_model_dir,
                                                                                     reference, sends):
    """A scheduler's notice (SIGTERM; SLURM's --signal=USR1@SECONDS) during step 3, between its micro-batches:
    the step finishes, its checkpoint (not a regular one) is written, the process exits 75 with one line,
    and the resumed run ends exactly where the uninterrupted one does."""
    run_dir = tmp_path / "run"
    stopped = _train(run_dir, tiny_model_dir, "train.backward:5", sends=sends)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("selfopd:")]
    assert line.startswith(f"selfopd: stopped by {sends} after step 3 of 4, its checkpoint written") and "--resume" in line
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00003"]
    assert max(m["step"] for m in _metrics(run_dir)) == 3
    _ok(_resume(run_dir))
    assert _metrics(run_dir) == reference


SHARDED = ("run.checkpoint_format=sharded", "run.checkpoint_every=1")


@pytest.mark.parametrize("kill_at", [
    "train.backward:5",     # step 3: step 2's shards written in the background while step 3 trained, or not yet
    "checkpoint.shards:3",  # step 3's shards written, the folder not yet renamed into place
])
def test_a_run_with_background_sharded_checkpoints_killed_resumes_to_the_same_metrics(tmp_path, tiny_model_dir,
                                                                                      reference, kill_at):
    """run.checkpoint_format = 'sharded' (DCP, written in the background): a kill during a write leaves
    the previous checkpoint the newest complete one, and the resumed run ends where the gathered run does;
    the last checkpoint holds the shards and the HF export."""
    run_dir = tmp_path / "run"
    _killed(_train(run_dir, tiny_model_dir, kill_at, extra=SHARDED))
    if kill_at.startswith("checkpoint."):
        assert (run_dir / "checkpoints" / ".step_00003.partial" / "dcp" / ".metadata").is_file()
        assert not (run_dir / "checkpoints" / "step_00003").exists()
    kept = list((run_dir / "checkpoints").glob("step_*"))  # the resume reads shards alone: no HF weights before the last step
    assert kept and not any((path / "model.safetensors").exists() for path in kept)
    _ok(_resume(run_dir))
    assert _metrics(run_dir) == reference
    last = run_dir / "checkpoints" / "step_00004"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [last.name]
    assert (last / "model.safetensors").is_file() and (last / "dcp" / ".metadata").is_file()


STALE = ("rollout.max_staleness=1",)


@pytest.fixture(scope="module")
def stale_reference(tmp_path_factory, tiny_model_dir) -> list[dict]:
    """An uninterrupted run that trains each step on rollouts sampled one step earlier."""
    run_dir = tmp_path_factory.mktemp("reference") / "stale"
    _ok(_train(run_dir, tiny_model_dir, extra=STALE))
    return _metrics(run_dir)


@pytest.mark.parametrize("kill_at", [
    "train.sampled:3",       # step 3 took the rollouts step 2's checkpoint saved; step 4's not yet asked for
    "train.backward:5",      # step 3, between its micro-batches: step 4's rollouts sampled, not saved
    "checkpoint.weights:2",  # step 4's checkpoint: weights written, trainer state and rollouts ahead not yet
])
def test_a_run_that_samples_ahead_resumes_to_the_same_metrics(tmp_path, tiny_model_dir, stale_reference, kill_at):
    """rollout.max_staleness = 1: what was sampled ahead of a checkpoint is saved with it, and what
    was sampled after it is sampled again by the same weights."""
    run_dir = tmp_path / "run"
    _killed(_train(run_dir, tiny_model_dir, kill_at, extra=STALE))
    _ok(_resume(run_dir))
    assert _metrics(run_dir) == stale_reference
    assert [m["rollout/staleness"] for m in stale_reference if "loss/pg" in m] == [0, 1, 1, 1]


def test_repeated_kills_at_random_moments_leave_whole_unique_metrics(tmp_path, tiny_model_dir, reference):
    """Seeded random kills one after another (fresh runs and resumes alike; this seed kills a
    fresh run before its first checkpoint, one mid-checkpoint, then two resumes), then a clean
    finish: the metrics read back whole and unique after every kill, equal at the end."""
    choices = random.Random(3)
    points = ["train.sampled", "train.backward", "checkpoint.weights", "checkpoint.renamed", "metrics.logged",
              "eval.written", "metrics.truncate"]
    run_dir, kills = tmp_path / "run", 0
    for _ in range(5):
        kill_at = f"{choices.choice(points)}:{choices.randint(1, 2)}"
        started = any((run_dir / "checkpoints").glob("step_*"))
        if not started:  # killed before its first checkpoint: the run starts again
            shutil.rmtree(run_dir, ignore_errors=True)
        result = _resume(run_dir, kill_at) if started else _train(run_dir, tiny_model_dir, kill_at)
        assert result.returncode in (0, KILLED), result.stderr[-3000:]
        if result.returncode == 0:
            break
        kills += 1
        if (run_dir / "metrics.jsonl").exists():
            _metrics(run_dir)  # whole, unique lines after every kill
    else:
        _ok(_resume(run_dir))
    assert kills >= 4
    assert _metrics(run_dir) == reference


@pytest.mark.slow
def test_real_model_run_killed_mid_backward_resumes_bit_for_bit(tmp_path, smollm2_dir):
    extra = ("run.steps=2", "run.checkpoint_every=1", "run.eval_every=0", "rollout.max_tokens=8")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _ok(_train(whole, smollm2_dir, extra=extra))
    _killed(_train(killed, smollm2_dir, "train.backward:3", extra=extra))  # step 2, between its micro-batches
    _ok(_resume(killed))
    assert _metrics(killed) == _metrics(whole)
    assert len([m for m in _metrics(whole) if "loss/pg" in m]) == 2


# --------------------------------------------------------------------------- compare


COMPARISON = """[compare]
name = "cmp"
out_dir = "{out}"
base = "{base}"
set = {shared}
[arms.opd]
set = ["loss.lambda_rl=0", "loss.lambda_opd=1"]
[arms.grpo]
set = ["loss.lambda_opd=0", "loss.lambda_rl=1"]
"""


def _compare(folder: Path, model: Path, kill_at: str = "") -> subprocess.CompletedProcess:
    """Two arms of two steps, checkpointed every step, in `folder`."""
    shared = [s for s in TRAIN if not s.startswith(("run.steps", "run.eval_every", "run.checkpoint_every"))]
    shared += ["run.steps=2", "run.eval_every=0", "run.checkpoint_every=1", f"model.student={model}"]
    path = folder / "cmp.toml"
    folder.mkdir(exist_ok=True)
    path.write_text(COMPARISON.format(out=folder, base=ROOT / "experiments" / "demo" / "demo.toml", shared=json.dumps(shared)))
    return _cli(["compare", str(path)], kill_at)


def _compare_results(folder: Path) -> tuple:
    """Each arm's metrics and the comparison's summary.json, wall times left out."""
    arms = {arm: _metrics(folder / "cmp" / "arms" / arm / "seed0") for arm in ("opd", "grpo")}
    return arms, _without_seconds(json.loads((folder / "cmp" / "summary.json").read_text()))


def _without_seconds(value):
    """A JSON value without its wall times (keys that name seconds), at any depth."""
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


@pytest.fixture(scope="module")
def compare_reference(tmp_path_factory, tiny_model_dir) -> tuple:
    folder = tmp_path_factory.mktemp("compare")
    _ok(_compare(folder, tiny_model_dir))
    return _compare_results(folder)


@pytest.mark.parametrize("kill_at", [
    "train.backward:7",        # the second arm's second step, mid micro-batches (its step 1 checkpointed)
    "compare.arm_trained:1",   # the first arm trained, its finished.json not yet written
])
def test_a_comparison_killed_mid_arm_finishes_with_the_same_results(tmp_path, tiny_model_dir, compare_reference,
                                                                     kill_at):
    _killed(_compare(tmp_path, tiny_model_dir, kill_at))
    rerun = _compare(tmp_path, tiny_model_dir)
    _ok(rerun)
    assert "resuming from step_0000" in rerun.stdout  # from the killed arm's checkpoint, not from scratch
    assert _compare_results(tmp_path) == compare_reference


# --------------------------------------------------------------------------- sft


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "solution": f"Add {a} and {b} to get {a + b}."}
            for a in range(1, 7) for b in range(1, 4)]
    data = tmp_path_factory.mktemp("sft-data") / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _sft(folder: Path, model: Path, data: Path, kill_at: str = "") -> subprocess.CompletedProcess:
    """Solution targets: 14 pairs in batches of 3, two epochs (10 steps), checkpointed every 3."""
    return _cli(["sft", *_sets([f"run.out_dir={folder}", "sft.name=teacher", f"model.student={model}",
                                f"data.spec={data}?solution=solution", "data.eval_size=4", "sft.train_examples=0",
                                "sft.epochs=2", "sft.batch_size=3", "sft.lr=1e-3", "eval.max_tokens=4",
                                "sft.checkpoint_every=3", "model.threads=1", "run.progress=false"])], kill_at)


def _sft_result(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    summary = _without_seconds(json.loads((folder / "teacher" / "summary.json").read_text()))
    del summary["model"]  # the folder's own path
    return summary, load_file(folder / "teacher" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, tiny_model_dir, sft_data) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("sft")
    _ok(_sft(folder, tiny_model_dir, sft_data))
    return _sft_result(folder)


@pytest.mark.parametrize("kill_at", [
    "sft.step:8",        # epoch 2 of 2, after step 8 (checkpointed at 6)
    "sft.checkpoint:2",  # the step-6 checkpoint written under its temporary name, not yet renamed
])
def test_sft_killed_mid_epoch_resumes_to_the_same_model_and_summary(tmp_path, tiny_model_dir, sft_data,
                                                                    sft_reference, kill_at):
    _killed(_sft(tmp_path, tiny_model_dir, sft_data, kill_at))
    assert (tmp_path / "teacher" / "checkpoint.pt").is_file()
    rerun = _sft(tmp_path, tiny_model_dir, sft_data)
    _ok(rerun)
    assert "continuing the fine-tuning from" in rerun.stdout
    (summary, weights), (expected_summary, expected_weights) = _sft_result(tmp_path), sft_reference
    assert summary == expected_summary and summary["steps"] == 10
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
    assert sorted(p.name for p in (tmp_path / "teacher").iterdir()) == [
        "README.md", "config.toml", "eval", "model", "summary.json", "targets.jsonl"]  # no checkpoint, no leftovers
