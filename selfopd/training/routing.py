"""Which teacher scores each example when a run has several (`[teachers.NAME]` beside `[teacher]`).

An example goes to the teacher its data row names (a `teacher` column of a file), else to the
teacher whose `tasks` hold its task (a mixed `data.spec`), else to `[teacher]` (named 'default').
The rule is checked on every example before any model loads: a row that names no teacher of the
config, a task that is not in the data, and a teacher that no training example reaches are
refused, naming the row or the key. Per step, each teacher's share of the completion tokens, its
mean advantage, KL and teacher-prefers-correct are logged (`teacher_metrics`), and a teacher that
gets no tokens for `guard.starved_teacher_steps` steps in a row is warned about (`starved_teachers`):
a starved teacher's other metrics are silent, not healthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from selfopd.config import DEFAULT_TEACHER, ConfigError, TrainConfig
from selfopd.data.example import Example
from selfopd.data.mixture import task_of
from selfopd.data.spec import TEACHER_COLUMN  # a data file's column that names each row's teacher
from selfopd.training.loss_metrics import preference_metrics


@dataclass(frozen=True)
class Router:
    """The routing rule of a run: `router(example)` is the name of the teacher that scores it."""

    by_task: Mapping[str, str]  # task -> teacher name, from [teachers.NAME] tasks

    def __call__(self, example: Example) -> str:
        named = row_teacher(example)
        return named if named is not None else self.by_task.get(task_of(example), DEFAULT_TEACHER)


def row_teacher(example: Example) -> str | None:
    """The teacher the example's data row names (its `teacher` column), if any."""
    value = example.meta.get("extra", {}).get(TEACHER_COLUMN)
    return None if value is None or str(value).strip() == "" else str(value).strip()


def open_router(config: TrainConfig, train_examples: Sequence[Example], eval_examples: Sequence[Example]) -> Router:
    """The run's routing rule, once every example's teacher exists and every named teacher gets examples."""
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


def where(example: Example) -> str:
    """The data row an example came from, as errors name it."""
    source, row = example.meta.get("source"), example.meta.get("row")
    return f"data row {row} of {source} (id {example.id!r})" if source is not None else f"data row {example.id!r}"


def teacher_metrics(names: Iterable[str], teacher_of: Sequence[str], lengths: Sequence[int],
                    signal_N: torch.Tensor, aligned: Sequence[bool],
                    outcomes: Sequence[tuple[int, bool]]) -> dict[str, float]:
    """Per teacher, over the step's rollouts it scored (`teacher_of[i]` scored rollout i, of
    `lengths[i]` completion tokens, whose per-token signal teacher - student is `signal_N`'s slice):
      teacher/NAME/token_share      its share of the step's completion tokens (0: starved)
      teacher/NAME/advantage_mean   mean teacher - student logprob over its tokens (absent with none)
      teacher/NAME/reverse_kl       mean student - teacher logprob: the sampled reverse KL
      teacher/NAME/correct_preference  teacher-prefers-correct over its prompt groups (as opd/...)
    A completion it could not read (`aligned` False) counts in its share, not in its means."""
    total = sum(lengths)
    pieces = signal_N.double().split(list(lengths))
    metrics: dict[str, float] = {}
    for name in names:
        mine = [i for i, t in enumerate(teacher_of) if t == name]
        tokens = sum(lengths[i] for i in mine)
        metrics[f"teacher/{name}/token_share"] = tokens / total if total else 0.0
        read = [pieces[i] for i in mine if aligned[i] and lengths[i]]
        if read:
            signal = torch.cat(read)
            metrics[f"teacher/{name}/advantage_mean"] = signal.mean().item()
            metrics[f"teacher/{name}/reverse_kl"] = -signal.mean().item()
        preference = preference_metrics((outcomes[i][0], outcomes[i][1], pieces[i].mean().item())
                                        for i in mine if aligned[i] and lengths[i])
        if "opd/correct_preference" in preference:
            metrics[f"teacher/{name}/correct_preference"] = preference["opd/correct_preference"]
    return metrics


def starved_teachers(history: Sequence[Mapping[str, float]], names: Iterable[str], steps: int) -> list[str]:
    """The teachers whose token share was 0 in each of the last `steps` training steps (0: never)."""
    if steps <= 0 or len(history) < steps:
        return []
    recent = history[-steps:]
    return [name for name in names
            if all(line.get(f"teacher/{name}/token_share", 1.0) == 0.0 for line in recent)]
