"""selfopd.comparisons.sft_training: a fine-tuning checkpoint is written whole and read back as data
only; one that asks for anything else (a pickle that runs a command) is refused with one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from selfopd.comparisons.sft_targets import Target, TargetStats
from selfopd.comparisons.sft_training import Prelude, SftCheckpoint, SftState, read_checkpoint, write_checkpoint
from selfopd.core.run_folder import CheckpointError
from selfopd.core.stats import MeanEstimate, Proportion
from selfopd.run.evaluate import EvalRecord


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("base", [Proportion(1, 2, 0.1, 0.9), MeanEstimate(0.5, 0.2, 0.8, 2)])
def test_a_checkpoint_reads_back_whole_as_data(tmp_path, base):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    record = EvalRecord("q1", 0, "1 + 1?", "2", "2", "2", True, "stop", 1)
    prelude = Prelude(base, [record], [Target("q1", [1, 2], [3], "3")], TargetStats("solution", items=1, kept=1),
                      0.25, {"eval_base": 1.5})
    written = SftCheckpoint({"sft.lr": 3e-5, "data.spec": "x"}, model.state_dict(), prelude,
                            SftState(4, [0.5, 0.4], optimizer.state_dict(), torch.get_rng_state()))
    write_checkpoint(tmp_path / "sft.pt", written)
    read = read_checkpoint(tmp_path / "sft.pt")
    assert read.prelude == prelude and read.settings == written.settings and read.state.losses == [0.5, 0.4]
    assert torch.equal(read.state.rng, written.state.rng) and torch.equal(read.model["weight"], model.weight)
    assert read.state.optimizer["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_a_checkpoint_that_runs_a_command_is_refused_and_runs_nothing(tmp_path):
    path, marker = tmp_path / "sft.pt", tmp_path / "ran"
    torch.save(SftCheckpoint({}, {}, RunsACommand(marker), SftState()), path)
    with pytest.raises(CheckpointError, match=rf"^{path}: not a fine-tuning checkpoint selfopd reads \(UnpicklingError: "
                                              r"Trying to load unsupported GLOBAL posix\.system.*delete it to start"):
        read_checkpoint(path)
    assert not marker.exists()


def test_a_file_of_other_data_is_named(tmp_path):
    torch.save({"step": 3}, tmp_path / "sft.pt")
    with pytest.raises(CheckpointError, match=r"sft\.pt: not a fine-tuning checkpoint \(it holds a dict\)"):
        read_checkpoint(tmp_path / "sft.pt")
