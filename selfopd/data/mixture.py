"""Several tasks in one run: `data.spec = "SPEC + SPEC"` (a plus sign between spaces).

Each part loads as a spec of its own; its examples carry `meta["task"]`, the part's source label
(`kb:countries`, `rg:basic_arithmetic`), so that a teacher template can branch on it
(`teacher/fact_sheet_or_answer_note` shows a fact sheet where the item has one and the answer
otherwise). Each task is split on its own (`data.eval_size` held-out prompts per task, or its
source's own split), every training step takes an equal share of its prompts from each task,
and each eval reports every task's accuracy beside the pooled one (`eval/accuracy/TASK`): a run
measures what it learns on one task and what it forgets of another at the same steps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from selfopd.data.example import Example
from selfopd.data.spec import DataError

SEPARATOR = " + "


def parts(spec: str) -> list[str]:
    """The specs of a mixture, in order (one for a plain spec); an empty part is an error."""
    pieces = [piece.strip() for piece in spec.split(SEPARATOR)]
    if len(pieces) > 1 and not all(pieces):
        raise DataError(f"{spec!r}: a mixture is SPEC + SPEC with a spec on each side of every ' + '")
    return pieces


def load_mixture(spec: str, load_one: Callable[[str], list[Example]], label_of: Callable[[str], str]) -> list[Example]:
    """Every part's examples, each tagged with its task, in the order of the parts."""
    examples, seen = [], {}
    for part in parts(spec):
        task = label_of(part)
        if task in seen:
            raise DataError(f"{spec!r}: two parts are task {task!r} ({seen[task]!r} and {part!r}); a mixture takes "
                            "each task once")
        seen[task] = part
        examples += [_tagged(example, task) for example in load_one(part)]
    return examples


def _tagged(example: Example, task: str) -> Example:
    return replace(example, meta={**example.meta, "task": task})


def task_of(example: Example) -> str:
    """The example's task in a mixture ('' outside one)."""
    return example.meta.get("task", "")


def by_task(examples: Sequence[Example]) -> dict[str, list[Example]]:
    """The examples of each task, tasks in order of first appearance, each keeping its order."""
    groups: dict[str, list[Example]] = {}
    for example in examples:
        groups.setdefault(task_of(example), []).append(example)
    return groups
