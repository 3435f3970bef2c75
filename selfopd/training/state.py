"""The state of one training run: plain data that the trainer, its set-up and its checks share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from selfopd.config import DEFAULT_TEACHER, TeacherConfig, TrainConfig
from selfopd.core.devices import autocast
from selfopd.core.distributed import World
from selfopd.training.ema import EmaWeights
from selfopd.engines.base import Engine
from selfopd.engines.local import pad_token_id
from selfopd.data.example import Example
from selfopd.core.run_folder import RunFolder
from selfopd.templating.templates import PromptTemplate
from selfopd.templating.token_bridge import TokenBridge
from selfopd.training.rollout_pipeline import RolloutPipeline, StudentSide
from selfopd.training.teacher import TeacherSide


@dataclass(frozen=True)
class NamedTeacher:
    """A [teachers.NAME] teacher of a run: its settings, engine (shared with every teacher of the same
    weights: `self` scores with the student's), templates and, with its own tokenizer, its bridge."""

    settings: TeacherConfig
    engine: Engine
    template: PromptTemplate
    demonstration_fallback: PromptTemplate | None = None
    bridge: TokenBridge | None = None


@dataclass
class Run:
    """The stateful pieces of one training run; `train_step` reads and advances them."""

    config: TrainConfig
    folder: RunFolder
    model: Any  # the student, trained in place
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    student_engine: Engine
    teacher_engine: Engine
    student_template: PromptTemplate
    teacher_template: PromptTemplate
    train_examples: list[Example]
    eval_examples: list[Example]  # the held-out split of data.spec (split.json, the probe)
    probe: tuple[list[int], list[int]]
    step: int = 0
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # servers, clients
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the trainer's
    world: World = field(default_factory=World)  # this process among torchrun's (one: rank 0 of 1)
    # Set iff the teacher template uses `demonstration`: it scores rollouts that have none.
    demonstration_fallback: PromptTemplate | None = None
    ema: EmaWeights | None = None  # teacher.kind = 'ema': the averaged weights the teacher serves
    bridge: TokenBridge | None = None  # teacher.tokenizer = 'own': the teacher's tokens and chat template
    named_teachers: dict[str, NamedTeacher] = field(default_factory=dict)  # [teachers.NAME], beside [teacher]
    router: Callable[[Example], str] | None = None  # with named teachers: each example's teacher
    eval_data: tuple[Example, ...] = ()  # eval.data's items, checked against the training prompts ('' : none)
    eval_template: PromptTemplate | None = None  # eval.student_template's ('': None, the student's)
    # The student's rollouts of this and the coming steps (rollout.max_staleness); synchronous by default.
    rollouts: RolloutPipeline = field(default_factory=lambda: RolloutPipeline(0, background=False))

    def close(self) -> None:
        """Close engine clients and stop the servers this run launched."""
        self.resources.close()

    @property
    def run_dir(self) -> Path:
        return self.folder.root

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer, self.model)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The compute precision (`model.dtype`) of one forward of the student: a region per
        forward, never around a step (`selfopd.core.devices.autocast` says why)."""
        return autocast(self.device, self.config.model.dtype)

    @property
    def rollouts_per_micro_batch(self) -> int:
        """Whole GRPO groups per forward/backward (and per teacher-scoring batch)."""
        return self.config.optim.micro_batch_prompts * self.config.rollout.samples_per_prompt

    @property
    def student_side(self) -> StudentSide:
        """What sampling the student's rollouts reads of this run (`selfopd.training.rollout_pipeline`)."""
        return StudentSide(self.config, self.tokenizer, self.student_engine, self.student_template,
                           self.train_examples, self.world)

    @property
    def teacher_side(self) -> TeacherSide:
        """What the teacher side of a step reads of this run (`selfopd.training.teacher`)."""
        return TeacherSide(self.config, self.tokenizer, self.teacher_engine, self.teacher_template,
                           self.demonstration_fallback, self.rollouts_per_micro_batch, self.temperature, self.bridge)

    @property
    def teacher_sides(self) -> dict[str, TeacherSide]:
        """Every teacher's side by name, [teacher] as 'default' first."""
        sides = {DEFAULT_TEACHER: self.teacher_side}
        for name, teacher in self.named_teachers.items():
            sides[name] = TeacherSide(self.config, self.tokenizer, teacher.engine, teacher.template,
                                      teacher.demonstration_fallback, self.rollouts_per_micro_batch, self.temperature,
                                      teacher.bridge, teacher.settings)
        return sides

    def teacher_of(self, example: Example) -> str:
        """The name of the teacher that scores `example` ('default' without named teachers)."""
        return self.router(example) if self.router is not None else DEFAULT_TEACHER

    @property
    def temperature(self) -> float:
        """The policy that is trained: the distribution the student samples from, its logits
        divided by the rollout temperature (as TRL does); greedy rollouts train at 1."""
        return self.config.rollout.temperature or 1.0
