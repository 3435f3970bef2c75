"""A training run's engines, by engine.kind: in process (`selfopd.engines.build`), vLLM servers launched
or given by URL (`selfopd.serving.launch`), or vLLM in the trainer's process (`selfopd.serving.colocate`).
The one place that decides among the kinds for `selfopd train`, and that hands the vLLM side the
sections it reads (`ServingSettings`) instead of the whole config."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Sequence

from selfopd.config import TrainConfig
from selfopd.config.bundles import ServingSettings
from selfopd.core.distributed import World
from selfopd.engines.base import Engine
from selfopd.engines.build import local_engine, open_local_engines, open_local_teacher
from selfopd.serving.gpu_layout import GPULayout


def open_training_engines(config: TrainConfig, model: Any, tokenizer: Any, log_dir: Path,
                          resources: contextlib.ExitStack, world: World = World()) -> tuple[Engine, Engine]:
    """(student engine, teacher engine) for a training run whose trainable student is `model`.

    In process, the student engine wraps `model` itself (a `self` teacher is the same engine
    with another prompt); a frozen, ema (whose copy `selfopd.training.ema` then averages in place)
    or external teacher is loaded on the student's device
    and, under torchrun, sharded like it. With vLLM, launched servers log to `log_dir` and
    are stopped when `resources` closes; with engine.teacher_engine = 'local' they only sample, and
    the teacher is in process as above. Colocated, vLLM runs in this process
    (`selfopd.serving.colocate`). An external teacher's tokenizer was checked by the caller
    (`selfopd.engines.build.external_teacher_bridge`)."""
    if config.engine.kind == "vllm":
        from selfopd.serving.launch import open_vllm_engines, open_vllm_engines_on_ranks

        settings, progress = ServingSettings.of(config), config.run.progress
        student, teacher = (open_vllm_engines_on_ranks(settings, log_dir, resources, world, progress)
                            if world.distributed else open_vllm_engines(settings, log_dir, resources, progress=progress))
        if teacher is None:  # engine.teacher_engine = 'local': vLLM samples, the trainer scores
            teacher = open_local_teacher(config.teacher, config, model, tokenizer,
                                         local_engine(config, model, tokenizer), world)
        return student, teacher
    if config.engine.kind == "vllm_colocate":
        from selfopd.serving.colocate import open_colocated_engines

        return open_colocated_engines(ServingSettings.of(config), resources)
    return open_local_engines(config, model, tokenizer, world)


def run_layout(config: TrainConfig, trainer_gpus: Sequence[int] | None = None) -> GPULayout:
    """The checked GPU layout of a training run on this machine (ConfigError if refused), before any model
    loads (`selfopd.serving.launch.run_layout`)."""
    from selfopd.serving.launch import run_layout as layout_of

    return layout_of(ServingSettings.of(config), trainer_gpus)
