"""`selfopd plan`: a training config's memory per GPU (trainer and vLLM servers), estimated from the
models' config.json and the layout before anything loads, with a one-line refusal when it cannot fit."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from selfopd.cli.common import UserError, add_overrides, command, number
from selfopd.config.settings import Bounds

GIB_BOUNDS = Bounds(gt=0, most=1e6)
COUNT_BOUNDS = Bounds(ge=1, most=1_000_000)


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    plan = command(commands, "plan", _plan, "memory per GPU of a training config (trainer and vLLM servers), "
                                            "estimated before anything loads; refuses in one line when it cannot fit")
    plan.add_argument("config", nargs="?", type=Path, help="TOML config (default: all defaults)")
    add_overrides(plan, "model.gradient_checkpointing=true")
    plan.add_argument("--gpu-memory-gib", type=number(float, GIB_BOUNDS),
                      help="memory of each GPU to plan for, GiB (e.g. 141 for an H200, 80 for an H100; default: GPU 0 "
                           "here, and no fit check without one)")
    plan.add_argument("--gpu-name", default="", help="name of the GPU planned for, as the refusal names it")
    plan.add_argument("--trainer-gpus", type=number(int, COUNT_BOUNDS),
                      help="trainer ranks under torchrun (FSDP world size; default: $WORLD_SIZE, else 1)")
    plan.add_argument("--prompt-tokens", type=number(int, COUNT_BOUNDS), default=256,
                      help="prompt length to assume, tokens (default: 256)")


def _plan(args: argparse.Namespace) -> int:
    from selfopd.config import load_config

    config = load_config(args.config, args.overrides)
    plan = memory_plan(config, args.gpu_memory_gib, args.gpu_name, args.trainer_gpus, args.prompt_tokens)
    print(plan.table())
    refusal = plan.refusal()
    if refusal:
        raise UserError(refusal)
    return 0


def memory_plan(config: Any, gpu_memory_gib: float | None = None, gpu_name: str = "", trainer_gpus: int | None = None,
                prompt_tokens: int = 256) -> Any:
    """The RunPlan of `config` on the GPUs given, or on this machine's."""
    from selfopd.config.auto import Machine
    from selfopd.config.bundles import PlanSettings
    from selfopd.planning.memory_fit import detected_gpu, plan_run

    here = detected_gpu()
    if gpu_memory_gib is None and here is not None:
        gpu_name, gpu_memory_gib = gpu_name or here[0], here[1]
    world = trainer_gpus or int(os.environ.get("WORLD_SIZE", "1") or 1)
    return plan_run(PlanSettings.of(config), capacity_gib=gpu_memory_gib, gpu_name=gpu_name or "GPU", world=world,
                    prompt_tokens=prompt_tokens, gpu_count=Machine.here().gpu_count if here is not None else None)


def show_plan(config: Any) -> str:
    """The plan as TOML comments, for `selfopd train --show-config` (its output stays a loadable config);
    a model whose config.json cannot be read here (a hub id offline) is said in one comment line."""
    from selfopd.config import ConfigError

    try:
        plan = memory_plan(config)
    except ConfigError as error:
        return f"\n# memory plan: not made here: {error}\n"
    refusal = plan.refusal()
    lines = plan.table().splitlines() + ([f"REFUSED: {refusal}"] if refusal else [])
    return "\n" + "".join(f"# {line}\n" for line in lines)
