"""The state of one training run: plain data that the trainer, its set-up and its checks share."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfopd.config import DEFAULT_TEACHER, TrainConfig
from selfopd.core.devices import autocast
from selfopd.core.distributed import World
from selfopd.training.ema import EmaWeights
from selfopd.engines.base import Engine
from selfopd.engines.local import pad_token_id
from selfopd.data.example import Example
from selfopd.data.routing import ONE_TEACHER, Router
from selfopd.core.run_folder import RunFolder
from selfopd.templating.chat_format import ChatFormat
from selfopd.episodes.sampling import EpisodeSampler, episode_sampler
from selfopd.templating.templates import PromptTemplate
from selfopd.training.grading import student_format
from selfopd.training.rollout_pipeline import RolloutPipeline, StudentSide
from selfopd.training.sharded_checkpoint import ShardedWriter
from selfopd.training.teacher import TeacherSide


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
    student_template: PromptTemplate
    # Every teacher by name, [teacher] as 'default' first (`selfopd.training.teachers.open_teachers`);
    # teachers of the same weights share one engine (`self` scores with the student's).
    teachers: dict[str, TeacherSide]
    train_examples: list[Example]
    eval_examples: list[Example]  # the held-out split of data.spec (split.json, the probe)
    probe: tuple[list[int], list[int]]
    step: int = 0
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # servers, clients
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the trainer's
    world: World = field(default_factory=World)  # this process among torchrun's (one: rank 0 of 1)
    ema: EmaWeights | None = None  # teacher.kind = 'ema': the averaged weights the teacher serves
    route: Router = ONE_TEACHER  # each example's teacher, by name (`selfopd.data.routing`)
    eval_data: tuple[Example, ...] = ()  # eval.data's items, checked against the training prompts ('' : none)
    eval_template: PromptTemplate | None = None  # eval.student_template's ('': None, the student's)
    # The student's rollouts of this and the coming steps (rollout.max_staleness); synchronous by default.
    rollouts: RolloutPipeline = field(default_factory=lambda: RolloutPipeline(0, background=False))
    # run.checkpoint_format = 'sharded': the DCP writer, a write possibly in flight (None: gathered checkpoints).
    checkpoint_writer: ShardedWriter | None = None

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
                           self.train_examples, self.world, self.student_chat, self.episodes)

    @functools.cached_property
    def episodes(self) -> EpisodeSampler | None:
        """How rollouts are sampled when they are episodes (`rollout.environment`); None: one answer each."""
        return episode_sampler(self.config.rollout, self.student_chat)

    @functools.cached_property
    def student_chat(self) -> ChatFormat:
        """The student's chat format (its prompts, and how its completions are graded), built once."""
        return student_format(self.config, self.tokenizer)

    @property
    def teacher(self) -> TeacherSide:
        """[teacher]'s side: the run's teacher when it has one, 'default' among several."""
        return self.teachers[DEFAULT_TEACHER]

    @property
    def several_teachers(self) -> bool:
        """The run has [teachers.NAME] tables beside [teacher]."""
        return len(self.teachers) > 1

    @property
    def temperature(self) -> float:
        """The policy that is trained: the distribution the student samples from, its logits
        divided by the rollout temperature (as TRL does); greedy rollouts train at 1."""
        return self.config.rollout.temperature or 1.0
