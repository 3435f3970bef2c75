"""Typed bundles of the sections that one side of selfopd reads of a training config: the vLLM side
(`selfopd.serving`) takes a `ServingSettings`, the memory planner (`selfopd.planning`) a `PlanSettings`,
and functions that read one or two sections take those sections themselves; neither package sees the
whole `TrainConfig`, so what each function depends on is in its signature. `X.of(config)` builds one
from a `TrainConfig` (the callers above them: training, run, cli)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfopd.config.compute import EngineConfig, ModelConfig
from selfopd.config.teachers import TeacherConfig

if TYPE_CHECKING:
    from selfopd.config import RolloutConfig, TrainConfig
    from selfopd.config.evaluation import EvalConfig


@dataclass(frozen=True)
class ServingSettings:
    """What the vLLM side reads: the student and its precision ([model]), the teacher a server serves
    ([teacher]), the servers and engines ([engine]), and the three other settings a server or a push is
    started with."""

    model: ModelConfig
    teacher: TeacherConfig
    engine: EngineConfig
    top_k: int  # loss.top_k: launched servers return at least this many logprobs per position
    in_flight: bool  # rollout.in_flight: a push freezes sampling requests in flight instead of waiting for them
    seed: int  # run.seed: the colocated vLLM's

    @staticmethod
    def of(config: TrainConfig) -> ServingSettings:
        return ServingSettings(config.model, config.teacher, config.engine, top_k=config.loss.top_k,
                               in_flight=config.rollout.in_flight, seed=config.run.seed)


@dataclass(frozen=True)
class PlanSettings:
    """What the memory planner reads: the models and their precision ([model], [teacher]), where they
    run ([engine]), the shape of a step's rollouts ([rollout]) and of the in-run eval ([eval]), the
    trainer's micro-batch (optim.micro_batch_prompts) and the loss's divergence (loss.divergence)."""

    model: ModelConfig
    teacher: TeacherConfig
    engine: EngineConfig
    rollout: RolloutConfig
    eval: EvalConfig
    micro_batch_prompts: int
    divergence: str

    @staticmethod
    def of(config: TrainConfig) -> PlanSettings:
        return PlanSettings(config.model, config.teacher, config.engine, config.rollout, config.eval,
                            micro_batch_prompts=config.optim.micro_batch_prompts, divergence=config.loss.divergence)
