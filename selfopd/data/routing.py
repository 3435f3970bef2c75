"""Which teacher scores each example when a run has several (`[teachers.NAME]` beside `[teacher]`).

An example goes to the teacher its data row names (a `teacher` column of a file), else to the
teacher whose `tasks` hold its task (a mixed `data.spec`), else to `[teacher]` (named 'default').
The rule is checked on every example before any model loads: a row that names no teacher of the
config, a task that is not in the data, and a teacher that no training example reaches are
refused, naming the row or the key. A run with `[teacher]` alone routes every example to it, and
reads no `teacher` column. The rule is the data's, so training (`selfopd.training.teachers`) and
diagnostics (`selfopd.diagnostics.teachers`) route alike; the per-step metrics of each teacher are
`selfopd.training.teacher_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from selfopd.config import DEFAULT_TEACHER, ConfigError, TrainConfig
from selfopd.data.example import Example
from selfopd.data.mixture import task_of
from selfopd.data.spec import TEACHER_COLUMN  # a data file's column that names each row's teacher


@dataclass(frozen=True)
class Router:
    """The routing rule of a run: `route(example)` is the name of the teacher that scores it."""

    by_task: Mapping[str, str] = field(default_factory=dict)  # task -> teacher name, from [teachers.NAME] tasks
    reads_rows: bool = True  # a data row's `teacher` column names its teacher (False: [teacher] alone)

    def __call__(self, example: Example) -> str:
        named = row_teacher(example) if self.reads_rows else None
        return named if named is not None else self.by_task.get(task_of(example), DEFAULT_TEACHER)


ONE_TEACHER = Router(reads_rows=False)  # a run with [teacher] alone: every example is its


def row_teacher(example: Example) -> str | None:
    """The teacher the example's data row names (its `teacher` column), if any."""
    value = example.meta.get("extra", {}).get(TEACHER_COLUMN)
    return None if value is None or str(value).strip() == "" else str(value).strip()


def open_router(config: TrainConfig, train_examples: Sequence[Example], eval_examples: Sequence[Example]) -> Router:
    """The run's routing rule, once every example's teacher exists and every named teacher gets examples
    (`ONE_TEACHER`, unchecked, without [teachers.NAME] tables)."""
    if not config.teachers:
        return ONE_TEACHER
    names = [DEFAULT_TEACHER, *config.teachers]
    for example in [*train_examples, *eval_examples]:
        named = row_teacher(example)
        if named is not None and named not in names:
            raise ConfigError("data.spec", f"{where(example)}: its {TEACHER_COLUMN!r} column names teacher {named!r}, "
                              f"which this config does not have (teachers: {', '.join(names)}; add a "
                              f"[teachers.{named}] table or fix the row)")
    router = Router({task: name for name, teacher in config.teachers.items() for task in teacher.tasks})
    tasks = {task_of(example) for example in train_examples}
    for name, teacher in config.teachers.items():
        missing = [task for task in teacher.tasks if task not in tasks]
        if missing:
            raise ConfigError(f"teachers.{name}.tasks", f"no task {missing[0]!r} in data.spec {config.data.spec!r}; its "
                              f"tasks: {', '.join(sorted(t or repr('') for t in tasks))}")
    reached = {router(example) for example in train_examples}
    for name in config.teachers:
        if name not in reached:
            raise ConfigError(f"[teachers.{name}]", "no training example is routed to this teacher: give it tasks of "
                              f"data.spec, or name it in the data's {TEACHER_COLUMN!r} column")
    return router


def routed_examples(examples: Sequence[Example], route: Router) -> dict[str, list[Example]]:
    """The examples each teacher scores, by name ('default' first, even with none)."""
    routed: dict[str, list[Example]] = {DEFAULT_TEACHER: []}
    for example in examples:
        routed.setdefault(route(example), []).append(example)
    return routed


def where(example: Example) -> str:
    """The data row an example came from, as errors name it."""
    source, row = example.meta.get("source"), example.meta.get("row")
    return f"data row {row} of {source} (id {example.id!r})" if source is not None else f"data row {example.id!r}"
