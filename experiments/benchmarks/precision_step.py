"""One real training step (`selfopd.training.trainer.train_step`) whose accumulated gradient is
captured just before the optimizer takes it: alone, under torchrun (FSDP2), or on the
rollouts of another run with the model's weights in another dtype. What the bf16 checks
compare: tests/training/test_precision.py on the CPU, experiments/benchmarks/gpu_check.py on a GPU.

    python -m experiments.benchmarks.precision_step CONFIG OUT [--set key=value ...] [--float64-on ROLLOUTS]
    python -m torch.distributed.run --standalone --nproc_per_node 2 experiments/benchmarks/precision_step.py CONFIG OUT

OUT (rank 0) is a torch file {"grads": {name: float64 full gradient or None}, "rollouts":
every rollout group of the step in order, as plain fields}, read back by `read_step` as data
(`weights_only`). `--float64-on` trains the model converted to float64 on those rollouts
instead of sampling (its own sampling numerics would draw others).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from selfopd.config import TrainConfig, load_config
from selfopd.core.distributed import all_gather, close_process_group, current_world
from selfopd.engines.base import Rollout
from selfopd.training.setup import build_run
from selfopd.training.trainer import train_step


def captured_step(config: TrainConfig, given_rollouts: list[Any] | None = None,
                  weights_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The step's gradients (full, float64, on the CPU) and its rollouts, the same on every
    rank. `given_rollouts`: train on these groups (every rank its share) instead of sampling;
    `weights_dtype`: convert the student to it first (float64: a reference)."""
    run = build_run(config)
    engine = run.student_engine
    sampled: list[Any] = []
    if weights_dtype is not None:
        run.model.to(weights_dtype)
    if given_rollouts is not None:
        def sample(prompts, params):  # the given rollouts of this rank's groups
            first = params.first_row // params.n
            return given_rollouts[first : first + len(prompts)]
    else:
        real_sample = engine.sample

        def sample(prompts, params):
            groups = real_sample(prompts, params)
            sampled.extend(groups)
            return groups

    engine.sample = sample
    grads: dict[str, torch.Tensor | None] = {}

    def capture(optimizer: Any, args: Any, kwargs: Any) -> None:
        for name, param in run.model.named_parameters():  # every rank: full_tensor is a collective
            grad = param.grad
            if grad is not None and hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            grads[name] = None if grad is None else grad.detach().double().cpu()

    run.optimizer.register_step_pre_hook(capture)
    try:
        train_step(run)
    finally:
        run.close()
    rollouts = [group for part in all_gather(sampled, run.world) for group in part]
    return {"grads": grads, "rollouts": rollouts or given_rollouts}


def relative_errors(grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per tensor |g - reference| / |reference| (L2); inf for a missing gradient, nan for a zero reference."""
    errors = {}
    for name, exact in reference.items():
        value = grads.get(name)
        if value is None or exact is None:
            errors[name] = float("inf") if exact is not None else float("nan")
        else:
            errors[name] = ((value - exact).norm() / exact.norm()).item()
    return errors


def write_step(result: dict[str, Any], path: str | Path) -> None:
    """`captured_step`'s result as a torch file of tensors and plain fields (no pickled classes)."""
    rollouts = [[dataclasses.asdict(rollout) for rollout in group] for group in result["rollouts"]]
    torch.save({"grads": result["grads"], "rollouts": rollouts}, path)


def read_step(path: str | Path) -> dict[str, Any]:
    """A `write_step` file, read as data (`weights_only`), its rollouts `Rollout`s again."""
    step = torch.load(path, weights_only=True)
    return {"grads": step["grads"], "rollouts": [[Rollout(**fields) for fields in group] for group in step["rollouts"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--float64-on", help="a torch file of rollouts (another OUT) to train on in float64")
    args = parser.parse_args()
    given = read_step(args.float64_on)["rollouts"] if args.float64_on else None
    result = captured_step(load_config(args.config, args.set), given, torch.float64 if given is not None else None)
    if current_world().is_main:
        write_step(result, args.out)
    close_process_group()


if __name__ == "__main__":
    main()
