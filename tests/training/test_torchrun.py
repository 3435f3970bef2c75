"""`torchrun --nproc_per_node 2 -m selfopd train`: two CPU processes (gloo, FSDP2) must take
the step one process takes on the whole batch, and a run resumed on two processes (or one)
from a two-process checkpoint must continue it exactly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfopd.config import load_config
from selfopd.core.distributed import World, padded_share
from selfopd.training.setup import check_world
from selfopd.training.trainer import train
from selfopd.run.tracking import untimed
from tests import two_processes

pytestmark = pytest.mark.distributed

# fp32. With one thread per process (model.threads = 1, as torchrun sets) and one micro-batch
# per rank the two runs are bit for bit equal (measured: 0 weights differ): the gradient is
# mb1 + mb2 on one process and the average of 2 x mb1 and 2 x mb2 over two ranks, both exact.
# With several micro-batches per rank only the order of the gradient sums differs (~1e-7
# relative), but AdamW's normalisation turns a gradient that is ~0 by cancellation into a
# step of its own: measured at lr 1e-4, 1 of 3.4M weights 1.05e-5 apart, the rest < 2e-6;
# other thread counts per process change every matmul's summation order alike. That case is
# checked on the step metrics (`test_micro_batches_accumulate_over_ranks`).
TOLERANCE = 1e-5


def _torchrun(*args: str) -> None:
    two_processes.torchrun("-m", "selfopd", "train", *args)


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:05d}" / "model.safetensors")


def _step_metrics(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: untimed(m) for m in lines if "loss/pg" in m}


def _assert_same_run(one: Path, two: Path, step: int, weights: bool = True) -> None:
    a, b = _weights(one, step), _weights(two, step)
    assert sorted(a) == sorted(b)
    worst = max((a[name] - b[name]).abs().max().item() for name in a)
    assert worst <= TOLERANCE or not weights, f"weights differ by {worst:.3g}"
    for number, metrics in _step_metrics(one).items():
        other = _step_metrics(two)[number]
        assert metrics.keys() == other.keys()
        for key, value in metrics.items():
            # grad_norm catches a wrongly scaled loss, which AdamW's update alone would hide.
            assert other[key] == pytest.approx(value, rel=1e-4, abs=TOLERANCE), (number, key)


@pytest.mark.parametrize("teacher", ["self", "frozen"])
def test_two_processes_take_the_step_of_one(tmp_path, tiny_model_dir, teacher):
    """A `self` teacher is the sharded student itself; a `frozen` one a second model, sharded alike."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir)
    one = train(load_config(config_file, ["run.name=one", f"teacher.kind={teacher}"]))
    _torchrun(str(config_file), "--set", "run.name=two", "--set", f"teacher.kind={teacher}")
    two = tmp_path / "runs" / "two"
    _assert_same_run(one, two, 2)
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert max((_weights(one, 2)[n] - initial[n]).abs().max().item() for n in initial) > 10 * TOLERANCE
    rollouts_one = (one / "rollouts" / "step_00001.jsonl").read_text().splitlines()
    rollouts_two = (two / "rollouts" / "step_00001.jsonl").read_text().splitlines()
    ids = lambda lines: [(r["id"], r["group"], r["completion_ids"]) for r in map(json.loads, lines)]  # noqa: E731
    assert ids(rollouts_one) == ids(rollouts_two) and len(rollouts_two) == 8  # every rank's rollouts, in order
    assert json.loads((two / "eval" / "step_00002" / "summary.json").read_text())["n"] == 5  # 5 prompts over 2 ranks


@pytest.mark.parametrize("staleness,checkpoints", [(0, "gathered"), (1, "sharded")])
def test_a_two_process_checkpoint_resumes_on_two_or_one_processes(tmp_path, tiny_model_dir, staleness, checkpoints):
    """With rollout.max_staleness = 1 the checkpoint holds both ranks' rollouts of step 2, sampled by the
    initial weights, and either resume trains on them. A sharded checkpoint (each rank's shards, written
    in the background) holds no HF weights before the last step, and resumes on 2 ranks or 1 alike."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir)
    stale = f"rollout.max_staleness={staleness}"
    whole = train(load_config(config_file, ["run.name=whole", stale]))
    _torchrun(str(config_file), "--set", "run.name=part", "--set", "run.steps=1", "--set", stale,
              "--set", f"run.checkpoint_format={checkpoints}", "--set", "run.export_every=0")
    part = tmp_path / "runs" / "part"
    if checkpoints == "sharded":  # run.steps = 1 made step 1 the last, which exports: drop its HF weights
        first = part / "checkpoints" / "step_00001"
        assert sorted(path.name for path in (first / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        (first / "model.safetensors").unlink()
    subprocess.run(["cp", "-r", str(part), str(tmp_path / "runs" / "part_one")], check=True)
    _torchrun("--resume", str(part), "--set", "run.steps=2")
    _assert_same_run(whole, part, 2)
    resumed_alone = train(load_config(tmp_path / "runs" / "part_one" / "config.toml",
                                      ["run.steps=2", "run.name=part_one"]), resume=True)
    _assert_same_run(whole, resumed_alone, 2)
    if staleness:
        assert [m["rollout/staleness"] for m in _step_metrics(part).values()] == [0, 1]


def test_lora_student_shards_and_takes_the_step_of_one(tmp_path, tiny_model_dir):
    """peft under FSDP2: the adapters after 2 steps on 2 processes are those of one process."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir)
    lora = ["model.lora_rank=4", "model.lora_targets=q_proj,v_proj"]
    one = train(load_config(config_file, ["run.name=one", *lora]))
    _torchrun(str(config_file), *[arg for item in ["run.name=two", *lora] for arg in ("--set", item)])
    files = [run / "checkpoints" / "step_00002" / "adapter_model.safetensors" for run in (one, tmp_path / "runs" / "two")]
    a, b = load_file(files[0]), load_file(files[1])
    assert sorted(a) == sorted(b) and len(a) == 8
    assert max((a[name] - b[name]).abs().max().item() for name in a) <= TOLERANCE
    assert max(a[name].abs().max().item() for name in a if "lora_B" in name) > 10 * TOLERANCE  # B starts at 0


def test_compiled_layers_shard_and_take_the_step_of_one(tmp_path, tiny_model_dir):
    """model.compile_layers under FSDP2: each rank's compiled layers (the sharded modules' forward) take
    the step one process takes with its compiled layers."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir)
    one = train(load_config(config_file, ["run.name=one", "run.steps=1", "model.compile_layers=true"]))
    _torchrun(str(config_file), "--set", "run.name=two", "--set", "run.steps=1", "--set", "model.compile_layers=true")
    _assert_same_run(one, tmp_path / "runs" / "two", 1)


def test_the_hybrid_qwen3_5_shards_and_takes_the_step_of_one(tmp_path, tiny_family_dirs):
    """FSDP2 units over Qwen3.5's Gated DeltaNet and attention layers: one step on 2 processes is one process's."""
    config_file = two_processes.config_file(tmp_path, tiny_family_dirs["qwen3_5"])
    one = train(load_config(config_file, ["run.name=one", "run.steps=1"]))
    _torchrun(str(config_file), "--set", "run.name=two", "--set", "run.steps=1")
    _assert_same_run(one, tmp_path / "runs" / "two", 1)


def test_micro_batches_accumulate_over_ranks(tmp_path, tiny_model_dir):
    """Two micro-batches per rank: the loss, KL, rewards and gradient norm of each step are
    those of one process (the weights: see TOLERANCE)."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir, micro_batch_prompts=1)
    one = train(load_config(config_file, ["run.name=one"]))
    _torchrun(str(config_file), "--set", "run.name=two")
    _assert_same_run(one, tmp_path / "runs" / "two", 2, weights=False)


@pytest.mark.parametrize("prompts", [3, 1])
def test_a_step_that_does_not_share_equally_is_the_step_of_one_process(tmp_path, tiny_model_dir, prompts):
    """3 prompts on 2 ranks (2 and 1, the second padded with one more), and 1 (the second rank all
    padding): the padding runs, weighs nothing, and is in no metric, so each step is one process's.
    engine.batch_size = 2 rows keeps the ranks' generation batches aligned with one process's."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir, micro_batch_prompts=1)
    sets = [f"rollout.prompts_per_step={prompts}", "engine.batch_size=2"]
    one = train(load_config(config_file, ["run.name=one", *sets]))
    _torchrun(str(config_file), "--set", "run.name=two", *(f"--set={s}" for s in sets))
    _assert_same_run(one, tmp_path / "runs" / "two", 2, weights=False)
    saved = [json.loads(line) for line in (tmp_path / "runs" / "two" / "rollouts" / "step_00001.jsonl").read_text().splitlines()]
    assert len(saved) == prompts * 2  # the padding's rollouts are not saved


def test_any_step_is_shared_by_any_number_of_ranks():
    check_world(load_config(None, ["rollout.prompts_per_step=10", "optim.micro_batch_prompts=5"]), World(rank=0, size=16))
    items = list(range(7))
    assert [padded_share(items, World(rank=r, size=3)) for r in range(3)] == [([0, 1, 2], 3), ([3, 4, 5], 3),
                                                                               ([6, 0, 1], 1)]
    assert [padded_share(items[:2], World(rank=r, size=4)) for r in range(4)] == [([0], 1), ([1], 1), ([0], 0),
                                                                                   ([0], 0)]
    assert padded_share(items, World()) == (items, 7)


def test_two_ranks_killed_with_a_sharded_write_unfinished_resume_from_the_checkpoint_before(tmp_path, tiny_model_dir):
    """kill -9 on both ranks once step 2's shards are written but not yet renamed into place: step 1's sharded
    checkpoint is the newest complete one, and the resume on two ranks ends as a run never killed does."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir)
    _torchrun(str(config_file), "--set", "run.name=whole")
    killed = two_processes.torchrun("-m", "selfopd", "train", str(config_file), "--set", "run.name=cut",
                                    "--set", "run.checkpoint_format=sharded", "--set", "run.checkpoint_every=1",
                                    env={"SELFOPD_KILL_AT": "checkpoint.shards:2"}, check=False)
    assert killed.returncode != 0, killed.stderr[-3000:]
    cut = tmp_path / "runs" / "cut"
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == [".step_00002.partial", "step_00001"]
    assert not (cut / "checkpoints" / "step_00001" / "model.safetensors").exists()  # the shards alone
    _torchrun("--resume", str(cut))
    _assert_same_run(tmp_path / "runs" / "whole", cut, 2)
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["step_00002"]


def test_a_signal_to_every_rank_mid_step_checkpoints_it_and_the_resumed_run_is_the_uninterrupted_one(tmp_path,
                                                                                                      tiny_model_dir):
    """torchrun passes a scheduler's SIGTERM to every rank: mid step 1 (between micro-batches) each finishes the
    step, step 1's checkpoint is written, every rank exits 75, and a resume on two ranks ends as a run never
    stopped does. Resumed on one process instead, it ends there too. The stopped run's checkpoints are sharded and
    written in the background: the stop waits for step 1's write and puts it in place before the ranks exit."""
    config_file = two_processes.config_file(tmp_path, tiny_model_dir, micro_batch_prompts=1)
    _torchrun(str(config_file), "--set", "run.name=whole")
    stopped = two_processes.torchrun("-m", "selfopd", "train", str(config_file), "--set", "run.name=cut",
                                     "--set", "run.checkpoint_format=sharded", env={"SELFOPD_KILL_AT": "train.backward:1", "SELFOPD_KILL_SIGNAL": "SIGTERM"},
                                     check=False)
    assert stopped.returncode != 0 and "stopped by SIGTERM after step 1 of 2" in stopped.stderr, stopped.stderr[-3000:]
    cut = tmp_path / "runs" / "cut"
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["step_00001"]
    assert (cut / "checkpoints" / "step_00001" / "dcp" / ".metadata").is_file()
    alone = tmp_path / "runs" / "alone"
    import shutil

    shutil.copytree(cut, alone)
    (alone / ".lock").unlink(missing_ok=True)
    _torchrun("--resume", str(cut))
    whole = tmp_path / "runs" / "whole"
    _assert_same_run(whole, cut, 2)
    train(load_config(alone / "config.toml", ["run.name=alone"]), resume=True)
    _assert_same_run(whole, alone, 2, weights=False)
