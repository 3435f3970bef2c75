"""Sharded checkpoints on one process: what a background write holds, when it counts, what a
damaged one is, and the settings around it. Two torchrun ranks and kills: test_torchrun.py and
test_kill_resume.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from selfopd.config import ConfigError, load_config
from selfopd.core.distributed import World
from selfopd.core.file_checks import checkpoint_problem
from selfopd.core.run_folder import CheckpointError, RunFolder
from selfopd.training.sharded_checkpoint import ShardedWriter, is_sharded_checkpoint, load_sharded

ROOT = Path(__file__).resolve().parents[2]


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 6)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("background", [True, False])
def test_a_write_holds_the_state_of_its_call_though_training_goes_on(tmp_path, background):
    """The shards hold the weights and AdamW moments as they were when `write` returned, not the later
    steps' (a background write copies first); loaded into a fresh model and optimizer, the next step is
    the one the writer's state would have taken, float for float; `finish` runs once, on completion."""
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer)
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    finished = []
    writer = ShardedWriter(World(), background=background)
    writer.write(model, optimizer, tmp_path, finish=lambda: finished.append(threading.current_thread().name))
    reference = _model_and_optimizer(1)
    reference[0].load_state_dict(saved)
    with torch.no_grad():  # the training goes on while a background write runs
        for parameter in model.parameters():
            parameter.add_(1.0)
    writer.wait()
    writer.wait()  # nothing in flight: a no-op
    assert len(finished) == 1 and is_sharded_checkpoint(tmp_path)

    loaded = _model_and_optimizer(2)
    load_sharded(*loaded, tmp_path, World())
    assert all(torch.equal(saved[name], value) for name, value in loaded[0].state_dict().items())
    moments = loaded[1].state_dict()["state"]
    assert moments[0]["step"].item() == 1 and moments[0]["exp_avg"].abs().sum() > 0
    torch.manual_seed(3)
    _step(*loaded)
    # the reference: the saved weights with the optimizer state restored from a second load
    load_sharded(*reference, tmp_path, World())
    torch.manual_seed(3)
    _step(*reference)
    assert all(torch.equal(a, b) for a, b in zip(loaded[0].parameters(), reference[0].parameters()))


def test_a_finish_that_fails_on_the_writing_thread_is_raised_by_wait(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    writer = ShardedWriter(World(), background=True)

    def finish() -> None:
        raise OSError(28, "No space left on device", str(tmp_path))

    writer.write(model, optimizer, tmp_path, finish=finish)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()


def _sharded_checkpoint(folder: Path, tiny_model_dir: Path) -> Path:
    """A checkpoint folder as a sharded save leaves it: config, trainer state, dcp/."""
    model, optimizer = _model_and_optimizer(0)
    checkpoint = folder / "checkpoints" / "step_00001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    torch.save({"optimizer": {}, "scheduler": {}, "step": 1}, RunFolder.trainer_state(checkpoint))
    ShardedWriter(World(), background=False).write(model, optimizer, checkpoint, finish=lambda: None)
    return checkpoint


def test_a_sharded_checkpoint_is_complete_only_whole(tmp_path, tiny_model_dir):
    checkpoint = _sharded_checkpoint(tmp_path, tiny_model_dir)
    assert checkpoint_problem(checkpoint, RunFolder.trainer_state(checkpoint)) is None
    (data,) = (checkpoint / "dcp").glob("*.distcp")
    data.write_bytes(b"")
    assert "empty" in checkpoint_problem(checkpoint, RunFolder.trainer_state(checkpoint))
    data.unlink()
    assert "no *.distcp" in checkpoint_problem(checkpoint, RunFolder.trainer_state(checkpoint))
    (checkpoint / "dcp" / ".metadata").unlink()
    assert "holds no weights" in checkpoint_problem(checkpoint, RunFolder.trainer_state(checkpoint))


def test_evaluating_a_step_without_hf_weights_names_the_steps_that_have_them(tmp_path, tiny_model_dir):
    _sharded_checkpoint(tmp_path, tiny_model_dir)
    with pytest.raises(CheckpointError, match=r"sharded weights only .*steps with HF weights: none"):
        RunFolder(tmp_path).kept_checkpoint(1)


def test_sharded_checkpoints_with_lora_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="run.checkpoint_format.*LoRA checkpoint already holds the adapters"):
        load_config(ROOT / "experiments/demo/demo.toml", ["run.checkpoint_format=sharded", "model.lora_rank=4"])
