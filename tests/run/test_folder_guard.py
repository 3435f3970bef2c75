"""What protects a run's results from the machine and from other runs, on the tiny model:
a NaN loss is skipped, then stops the run; a second process on the same run folder is
refused with the first's PID; an unwritable folder is refused before any model loads; a
full disk stops the run with one line naming the file, the last checkpoint intact."""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfopd.cli import main
from selfopd.config import load_config
from selfopd.run.folder_guard import folder_lock
from selfopd.training.trainer import SKIPPED, build_run, train_step

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6", "optim.micro_batch_prompts=1",
    "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false", "run.eval_every=0",
]


def _sets(*sets: str) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def _train_argv(model: Path, out: Path, *sets: str) -> list[str]:
    return ["train", str(ROOT / "experiments" / "demo" / "demo.toml"),
            *_sets(*SMALL, f"model.student={model}", f"run.out_dir={out}", "run.name=run", *sets)]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _cli(argv: list[str], **options) -> subprocess.CompletedProcess:
    """`python -m selfopd ARGV` in a fresh process (this checkout's selfopd)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **options.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "selfopd", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, **options)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("selfopd: error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def poisoned_teacher(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with a NaN in its final norm: every logprob it gives is NaN."""
    folder = tmp_path_factory.mktemp("poisoned") / "teacher"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][7] = math.nan
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished one-step run (external teacher: the tiny model itself) with its checkpoint."""
    out = tmp_path_factory.mktemp("one_step")
    argv = _train_argv(tiny_model_dir, out, "run.steps=1", "teacher.kind=external", f"teacher.model={tiny_model_dir}")
    assert main(argv) == 0
    return out / "run"


def test_a_nonfinite_loss_skips_the_step_and_keeps_the_weights(tmp_path, tiny_model_dir, poisoned_teacher):
    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
                                "teacher.kind=external", f"teacher.model={poisoned_teacher}"])
    run = build_run(config)
    before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert metrics["skipped"] == SKIPPED and math.isnan(metrics["loss/pg"]) and run.step == 1
    assert all(torch.equal(p, before[name]) for name, p in run.model.named_parameters())
    assert not any(state for state in run.optimizer.state.values())  # AdamW took no step: no moments
    run.close()


def test_nonfinite_steps_in_a_row_stop_the_run_with_its_checkpoint_intact(tmp_path, one_step_run, poisoned_teacher,
                                                                          capsys):
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    checkpoint = _snapshot(run / "checkpoints")
    argv = ["train", "--resume", str(run), *_sets("run.steps=6", "run.checkpoint_every=0",
                                                   f"teacher.model={poisoned_teacher}", "optim.max_nonfinite_steps=2")]
    assert main(argv) == 1
    error = _error_line(capsys.readouterr().err)
    assert "steps 2 to 3: 2 steps in a row had a NaN or inf loss or gradient (optim.max_nonfinite_steps = 2)" in error
    assert f"last checkpoint: {run / 'checkpoints' / 'step_00001'}" in error
    assert _snapshot(run / "checkpoints") == checkpoint
    steps = [m for m in _metrics(run) if "loss/pg" in m]
    assert [(m["step"], m.get("skipped")) for m in steps] == [(1, None), (2, SKIPPED), (3, SKIPPED)]


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_is_refused_with_the_first_ones_pid(tmp_path, tiny_model_dir):
    out = tmp_path / "runs"
    first = subprocess.Popen([sys.executable, "-m", "selfopd", *_train_argv(tiny_model_dir, out, "run.steps=100000")],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = out / "run" / ".lock"
    try:
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.2)
        for argv in (_train_argv(tiny_model_dir, out, "run.steps=2"), ["train", "--resume", str(out / "run")]):
            second = _cli(argv)
            assert second.returncode == 1
            assert f"{out / 'run'} is in use by another selfopd process (PID {first.pid})" in _error_line(second.stderr)
    finally:
        first.kill()  # kill -9: the OS releases the lock with the process
        first.wait()
    with folder_lock(out / "run"):  # no stale lock
        assert lock.read_text().strip() == str(os.getpid())


PR_CAPBSET_DROP = 24  # prctl(2)
DAC_CAPABILITIES = (1, 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: what lets root ignore file permissions


def _bound_by_permissions() -> None:
    """A child's preexec_fn: as root, drop the capabilities that override file permissions from the
    bounding set, so that after exec the child (still root, owner of its files) is refused a
    0o500 folder as any user is. CI runs as root: this is how the test runs there, never skipped."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in DAC_CAPABILITIES:
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {capability})")


def _in_unwritable(folder: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`selfopd ARGV` in a child for which `folder` (chmod 0o500) refuses new files."""
    folder.chmod(0o500)
    try:
        return _cli(argv, preexec_fn=_bound_by_permissions)
    finally:
        folder.chmod(0o755)


def test_an_unwritable_folder_is_refused_before_any_model_loads(tmp_path, one_step_run):
    out = tmp_path / "runs"
    out.mkdir()
    fresh = _train_argv(tmp_path / "no-model-needed", out, "run.name=fresh")
    result = _in_unwritable(out, fresh)
    assert result.returncode == 1
    assert _error_line(result.stderr).startswith(f"selfopd: error: {out}/fresh: cannot write in {out}: Permission denied")
    assert list(out.iterdir()) == []
    run = out / "run"
    shutil.copytree(one_step_run, run)
    before = _snapshot(run)
    result = _in_unwritable(run, ["train", "--resume", str(run), "--set", "run.steps=2"])
    assert result.returncode == 1
    assert _error_line(result.stderr).startswith(f"selfopd: error: {run}: cannot write in {run}: Permission denied")
    assert _snapshot(run) == before


def _full_disk(limit_bytes: int):
    """Run the child as on a full disk: any file past `limit_bytes` fails to grow (EFBIG)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return limit


@pytest.mark.slow
def test_a_full_disk_stops_the_run_naming_the_file_with_the_last_checkpoint_intact(tmp_path, one_step_run):
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    checkpoint = _snapshot(run / "checkpoints" / "step_00001")
    # Small files still fit, the next checkpoint's weights (12 MB) do not.
    result = _cli(["train", "--resume", str(run), *_sets("run.steps=3", "run.checkpoint_every=1")],
                  preexec_fn=_full_disk(1 << 20))
    assert result.returncode == 1
    error = _error_line(result.stderr)
    assert f"cannot write {run / 'checkpoints' / 'step_00002'}" in error and "File too large" in error
    assert f"its last complete checkpoint {run / 'checkpoints' / 'step_00001'} is intact" in error
    assert _snapshot(run / "checkpoints" / "step_00001") == checkpoint and (run / "checkpoints" / "step_00001").is_dir()
    assert [m["step"] for m in _metrics(run) if "loss/pg" in m] == [1, 2]  # every line whole


def test_a_comparison_in_use_is_refused_with_the_pid_that_holds_it(tmp_path, capsys):
    config = tmp_path / "cmp.toml"
    config.write_text(f'[compare]\nname = "cmp"\nbase = "{ROOT / "experiments" / "demo" / "demo.toml"}"\nout_dir = "{tmp_path}"\n'
                      'seeds = [0]\nset = ["run.steps=1"]\n\n[arms.only]\nset = ["optim.lr=1e-6"]\n')
    (tmp_path / "cmp").mkdir()
    with folder_lock(tmp_path / "cmp"):
        assert main(["compare", str(config)]) == 1
    assert f"{tmp_path / 'cmp'} is in use by another selfopd process (PID {os.getpid()})" in \
        _error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == [".lock"]
