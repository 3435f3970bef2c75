"""One teacher of a run with several (`[teachers.NAME]`): `selfopd diagnose` reports each on the
rollouts it scored and the prompts routed to it (by `selfopd.data.routing`, as training routes them),
with its own table's templates, chat-template arguments and weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfopd.config import DEFAULT_TEACHER, TrainConfig
from selfopd.core.run_folder import RunFolder
from selfopd.data.example import Example
from selfopd.data.routing import open_router
from selfopd.run.rollouts import RolloutRecord


def run_teachers(run_dir: Path) -> list[str]:
    """The names of a run's teachers: ['default'], then its [teachers.NAME] tables."""
    from selfopd.config import load_config

    return [DEFAULT_TEACHER, *load_config(RunFolder(run_dir).config).teachers]


def one_teachers_part(run_dir: Path, config: TrainConfig, teacher: str, by_step: dict[int, list[RolloutRecord]],
                      train_examples: list[Example], eval_examples: list[Example]) -> tuple[Any, ...]:
    """(`teacher`'s saved rollouts by step, the training and held-out examples routed to it), by the
    run's routing rule (`selfopd.data.routing`); its table is `teacher_tables(config)[teacher]`."""
    names = [DEFAULT_TEACHER, *config.teachers]
    if teacher not in names:
        raise ValueError(f"{run_dir}: no teacher {teacher!r}; its teachers: {', '.join(names)}")
    route = open_router(config, train_examples, eval_examples)
    mine = {step: [r for r in records if (r.teacher or DEFAULT_TEACHER) == teacher] for step, records in by_step.items()}
    mine = {step: records for step, records in mine.items() if records}
    if not mine:
        raise ValueError(f"{run_dir}: no saved rollout was scored by teacher {teacher!r}")
    return mine, [e for e in train_examples if route(e) == teacher], [e for e in eval_examples if route(e) == teacher]
