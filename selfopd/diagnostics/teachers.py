"""One teacher of a run with several (`[teachers.NAME]`): `selfopd diagnose` reports each on the
rollouts it scored and the prompts routed to it, as if it were the run's only teacher."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from selfopd.core.run_folder import RunFolder
from selfopd.data.example import Example
from selfopd.run.rollouts import RolloutRecord


def run_teachers(run_dir: Path) -> list[str]:
    """The names of a run's teachers: ['default'], then its [teachers.NAME] tables."""
    from selfopd.config import DEFAULT_TEACHER, load_config

    return [DEFAULT_TEACHER, *load_config(RunFolder(run_dir).config).teachers]


def one_teachers_part(run_dir: Path, config: Any, teacher: str, by_step: dict[int, list[RolloutRecord]],
                      train_examples: list[Example], eval_examples: list[Example]) -> tuple[Any, ...]:
    """(the config with `teacher`'s table as [teacher] and no others, its saved rollouts by step, the
    training and held-out examples routed to it)."""
    from selfopd.config import DEFAULT_TEACHER
    from selfopd.training.routing import open_router

    names = [DEFAULT_TEACHER, *config.teachers]
    if teacher not in names:
        raise ValueError(f"{run_dir}: no teacher {teacher!r}; its teachers: {', '.join(names)}")
    router = open_router(config, train_examples, eval_examples)
    table = config.teacher if teacher == DEFAULT_TEACHER else dataclasses.replace(config.teachers[teacher], tasks=())
    mine = {step: [r for r in records if (r.teacher or DEFAULT_TEACHER) == teacher] for step, records in by_step.items()}
    mine = {step: records for step, records in mine.items() if records}
    if not mine:
        raise ValueError(f"{run_dir}: no saved rollout was scored by teacher {teacher!r}")
    return (dataclasses.replace(config, teacher=table, teachers={}), mine,
            [e for e in train_examples if router(e) == teacher], [e for e in eval_examples if router(e) == teacher])
