"""One real training step (`selfopd.trainer.train_step`) whose accumulated gradient is
captured just before the optimizer takes it: alone, under torchrun (FSDP2), or in float64
on rollouts saved by another run. tests/test_precision.py compares the three.

    python tests/precision_step.py CONFIG OUT [--set key=value ...] [--float64-on ROLLOUTS]
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/precision_step.py CONFIG OUT ...

OUT (rank 0) is a torch file {"grads": {name: float64 full gradient or None}, "rollouts":
every rollout group of the step in order}. `--float64-on` trains the model converted to
float64 on those rollouts instead of sampling (its own sampling numerics would draw others).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selfopd.config import load_config  # noqa: E402
from selfopd.distributed import all_gather  # noqa: E402
from selfopd.run_setup import build_run  # noqa: E402
from selfopd.trainer import train_step  # noqa: E402


def captured_step(config_file: str | Path, overrides: list[str], float64_on: Any = None) -> dict[str, Any]:
    """The step's gradients (full, float64, on the CPU) and its rollouts; the same on every rank."""
    run = build_run(load_config(config_file, overrides))
    engine = run.student_engine
    sampled: list[Any] = []
    if float64_on is not None:
        run.model.double()

        def sample(prompts, params):  # the given rollouts of this rank's groups
            first = params.first_row // params.n
            return float64_on[first : first + len(prompts)]
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
    return {"grads": grads, "rollouts": rollouts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--float64-on", help="a torch file of rollouts (another OUT) to train on in float64")
    args = parser.parse_args()
    given = torch.load(args.float64_on, weights_only=False)["rollouts"] if args.float64_on else None
    result = captured_step(args.config, args.set, given)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
