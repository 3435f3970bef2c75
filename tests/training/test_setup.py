"""selfopd.training.setup, on resume: a checkpoint is data. The trainer state is read with
`weights_only` (a crafted pickle is refused with one line and runs nothing), and an incomplete
newest checkpoint is skipped, with a warning line, for the newest complete one."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from selfopd.cli import main
from selfopd.core.run_folder import CheckpointError, RunFolder
from selfopd.training.setup import load_trainer_state

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6", "optim.micro_batch_prompts=1",
    "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false", "run.eval_every=0", "model.threads=1",
]


class RunsACommand:
    """What a crafted trainer_state.pt holds: unpickling it would call os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _sets(*sets: str) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("one_step")
    argv = ["train", str(ROOT / "experiments" / "demo" / "demo.toml"),
            *_sets(*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={out}", "run.name=run", "run.steps=1")]
    assert main(argv) == 0
    return out / "run"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("torch_file", [True, False], ids=["torch.save-zip", "plain-pickle"])
def test_a_crafted_trainer_state_runs_nothing(tmp_path, torch_file):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "step_00001"
    checkpoint.mkdir()
    path = RunFolder.trainer_state(checkpoint)
    if torch_file:
        torch.save({"optimizer": RunsACommand(marker), "scheduler": {}, "step": 1}, path)
    else:
        path.write_bytes(pickle.dumps(RunsACommand(marker)))
    with pytest.raises(CheckpointError, match=rf"^{path}: not a trainer state selfopd reads \(UnpicklingError: .*"
                                              r"(GLOBAL posix\.system|Unsupported operand)"):
        load_trainer_state(checkpoint)
    assert not marker.exists()


def test_a_trainer_state_of_other_data_is_named(tmp_path):
    torch.save([1, 2, 3], RunFolder.trainer_state(tmp_path))
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt: not a trainer state \(expected optimizer"):
        load_trainer_state(tmp_path)


def test_resuming_a_run_whose_trainer_state_runs_code_is_one_line_and_changes_nothing(tmp_path, one_step_run, capsys):
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    marker = tmp_path / "ran"
    state = RunFolder.trainer_state(RunFolder(run).checkpoint(1))
    torch.save({"optimizer": RunsACommand(marker), "scheduler": {}, "step": 1}, state)
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--set", "run.steps=2"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("selfopd: ")]
    assert "Traceback" not in err and lines == [
        f"selfopd: error: {state}: not a trainer state selfopd reads (UnpicklingError: Trying to load unsupported "
        "GLOBAL posix.system whose module posix is blocked.); only tensors, numbers, text and lists are read from it, "
        "never code; resume from a checkpoint selfopd wrote, or start the run again"]
    assert not marker.exists() and _snapshot(run) == before


def test_a_trainer_state_without_optimizer_state_or_shards_is_one_line(tmp_path, one_step_run, capsys):
    """A sharded checkpoint's trainer state (optimizer state under dcp/), its dcp/ folder lost but its HF
    export kept: the resume names what is missing instead of a KeyError."""
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    checkpoint = RunFolder(run).checkpoint(1)
    state = torch.load(RunFolder.trainer_state(checkpoint), weights_only=True)
    torch.save({**state, "optimizer": {}}, RunFolder.trainer_state(checkpoint))
    assert main(["train", "--resume", str(run), "--set", "run.steps=2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"selfopd: error: {checkpoint}: its trainer state holds no optimizer state" in err


@pytest.mark.parametrize("damage", ["empty", "truncated-weights", "truncated-state"])
def test_an_incomplete_newest_checkpoint_is_skipped_with_a_warning(tmp_path, one_step_run, capsys, damage):
    """A newer checkpoint a kill or a full disk left incomplete: the run resumes from the last
    complete one, says so in one warning line, and trains the steps after it again."""
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    folder = RunFolder(run)
    newer = folder.checkpoint(2)
    if damage == "empty":
        newer.mkdir()
        why = f"{newer}: empty (its write was cut short)"
    else:
        shutil.copytree(folder.checkpoint(1), newer)
        path = newer / ("model.safetensors" if damage == "truncated-weights" else "trainer_state.pt")
        path.write_bytes(path.read_bytes()[:4096])
        why = f"{path}: "
    assert main(["train", "--resume", str(run), "--set", "run.steps=2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfopd: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"selfopd: warning: skipping an incomplete checkpoint: {why}")
    assert warnings[0].endswith(f"resuming from {folder.checkpoint(1)}, the newest complete one (the steps after it "
                                "run again)")
    assert folder.latest_checkpoint() == newer and load_trainer_state(newer)["step"] == 2
    steps = [json.loads(line) for line in folder.metrics.read_text().splitlines()]
    assert [line["step"] for line in steps if "loss/pg" in line] == [1, 2]
