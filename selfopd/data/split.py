"""Held-out prompts: the train / eval split, the prompt identity it rests on, and the record
a run keeps of it.

The distinct prompt is the unit of every accuracy selfopd reports: greedy decoding answers
a repeated prompt the same way every time, so a prompt that appears 18 times in an eval
set is one observation, not 18. The split therefore works on prompts: an eval set holds
each prompt once, and no eval prompt is ever trained on. A run folder records its split
(`split.json`: the eval items' ids and every prompt's key), so `selfopd eval --run` scores
exactly that run's held-out prompts and can refuse an eval set that overlaps its training
prompts, whatever the data spec says today.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

from selfopd.core.atomic import write_text_atomic
from selfopd.core.run_folder import RunFolder
from selfopd.data import DataError, check_unique_ids
from selfopd.data.mixture import by_task
from selfopd.data.example import Example, prompt_key



def distinct_prompts(examples: Iterable[Example]) -> int:
    return len({prompt_key(e.prompt) for e in examples})


def split_examples(
    examples: list[Example],
    *,
    eval_size: int | None = None,
    eval_fraction: float | None = None,
    seed: int = 0,
    by: Literal["prompt", "id"] = "prompt",
) -> tuple[list[Example], list[Example]]:
    """Deterministic (train, eval) split, the same in every process for the same seed.

    Groups examples by prompt (or id), orders the groups by sha256(seed, key) and gives the
    first `eval_size` groups to eval, one example each: an eval set never repeats a prompt,
    and no eval prompt appears in train (its duplicates are dropped from both). Train keeps
    every other example, duplicates included. Both parts keep the input order.
    `eval_fraction` is a share of the distinct groups.

    A source that fixes its own split (`selfopd.data.knowledge`: held-out phrasings of trained
    facts) marks every example `meta["split"]` = "train" or "eval": the held-out groups are then
    drawn from the "eval" ones only (all of them when `eval_size` is larger), and train keeps the
    "train" ones only.

    A mixture (`selfopd.data.mixture`) is split task by task, `eval_size` (or `eval_fraction`)
    per task, each its own way; train and eval list the tasks in order.
    """
    tasks = by_task(examples)
    if len(tasks) > 1:
        halves = []
        for task, part in tasks.items():
            try:
                halves.append(split_examples(part, eval_size=eval_size, eval_fraction=eval_fraction, seed=seed, by=by))
            except DataError as error:
                raise DataError(f"task {task}: {error}") from None
        return [e for train, _ in halves for e in train], [e for _, held in halves for e in held]
    if (eval_size is None) == (eval_fraction is None):
        raise DataError("split_examples: give exactly one of eval_size, eval_fraction")
    if by not in ("prompt", "id"):
        raise DataError(f"split_examples: by must be 'prompt' or 'id', got {by!r}")
    check_unique_ids(examples, "split_examples")
    groups: dict[str, list[str]] = {}
    for ex in examples:
        groups.setdefault(prompt_key(ex.prompt) if by == "prompt" else ex.id, []).append(ex.id)
    fixed = _fixed_split(examples)
    # The groups that may be held out, with the rows that may represent them: under a source's own
    # split, those with an "eval" row, represented by one.
    candidates = groups if fixed is None else {
        key: eval_rows for key, ids in groups.items() if (eval_rows := [i for i in ids if fixed[i] == "eval"])}
    if fixed is not None and eval_size is not None:  # the source's held-out rows, at most eval_size of them
        eval_size = min(eval_size, len(candidates))
    if eval_fraction is not None:
        if not 0.0 <= eval_fraction <= 1.0:
            raise DataError(f"split_examples: eval_fraction must be in [0, 1], got {eval_fraction}")
        eval_size = round(eval_fraction * len(candidates))
    if not 0 <= eval_size <= len(candidates):
        unit = "distinct prompts" if by == "prompt" else "examples"
        raise DataError(f"split_examples: eval_size must be in [0, {len(candidates)}] (the data holds "
                        f"{len(candidates)} {unit} in {len(examples)} examples), got {eval_size}")

    def rank(key: str) -> str:
        return hashlib.sha256(f"{seed}\0{key}".encode()).hexdigest()

    held_out = sorted(candidates, key=rank)[:eval_size]
    eval_ids = {candidates[key][0] for key in held_out}
    dropped = {example_id for key in held_out for example_id in groups[key]}
    if fixed is not None:  # its "eval" rows are never trained on, held out or not
        dropped |= {example_id for example_id, mark in fixed.items() if mark == "eval"}
    return ([ex for ex in examples if ex.id not in dropped], [ex for ex in examples if ex.id in eval_ids])


def _fixed_split(examples: Sequence[Example]) -> dict[str, str] | None:
    """Each example's `meta["split"]` when the source fixed one (all or none must), else None."""
    marks = {ex.id: ex.meta.get("split") for ex in examples}
    if not any(mark is not None for mark in marks.values()):
        return None
    bad = next((i for i, m in marks.items() if m not in ("train", "eval")), None)
    if bad is not None:
        raise DataError(f"split_examples: example {bad!r} has meta split {marks[bad]!r}; a source that fixes the "
                        "split marks every example 'train' or 'eval'")
    return marks  # type: ignore[return-value]


@dataclass(frozen=True)
class SplitRecord:
    """What a run trains on and is evaluated on, as prompt keys: written once when the run
    starts, checked when it resumes, read by `selfopd eval --run`."""

    data: str  # the data spec the split came from
    split_seed: int
    eval_ids: list[str]  # held-out items, in eval order
    eval_prompts: list[str]  # their prompt keys, same order
    train_prompts: list[str]  # sorted distinct keys of every training prompt

    @classmethod
    def of(cls, data: str, split_seed: int, train: Sequence[Example], held_out: Sequence[Example]) -> SplitRecord:
        return cls(data, split_seed, [e.id for e in held_out], [prompt_key(e.prompt) for e in held_out],
                   sorted({prompt_key(e.prompt) for e in train}))

    def write(self, run_dir: Path) -> Path:
        return write_text_atomic(RunFolder(run_dir).split, json.dumps(asdict(self)) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> SplitRecord:
        """The record a run folder holds; anything but the layout `write` gives is one DataError naming the file."""
        path = RunFolder(run_dir).split
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no split record (runs record their held-out prompts when they start)")
        try:
            fields = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise DataError(f"{path}: not a split record (not valid JSON: {error}); the run folder is damaged") from None
        if not (isinstance(fields, dict) and fields.keys() == set(cls.__dataclass_fields__)
                and isinstance(fields["data"], str) and type(fields["split_seed"]) is int
                and all(isinstance(fields[key], list) and all(isinstance(item, str) for item in fields[key])
                        for key in ("eval_ids", "eval_prompts", "train_prompts"))):
            raise DataError(f"{path}: not a split record (expected data, split_seed, eval_ids, eval_prompts and "
                            "train_prompts); the run folder is damaged")
        return cls(**fields)

    def check_same(self, other: SplitRecord, where: str) -> None:
        """Refuse to go on when the data a run resolves to now is not what it started with."""
        if other.eval_prompts != self.eval_prompts or other.train_prompts != self.train_prompts:
            changed = len(set(other.eval_prompts) ^ set(self.eval_prompts))
            raise DataError(f"{where}: the data now gives another split than the run recorded ({changed} held-out "
                            f"prompts differ; data {self.data!r}, split seed {self.split_seed}): the data or the "
                            "loader changed since the run started; start a new run")


def trained_on(examples: Iterable[Example], trained: Iterable[str]) -> list[Example]:
    """The examples whose prompt is one of the `trained` prompt keys (`prompt_key`): what a run's split
    record (`SplitRecord.train_prompts`), an sft teacher's record or a run's training set trained on."""
    keys = set(trained)
    return [e for e in examples if prompt_key(e.prompt) in keys]


def load_split(spec: str, eval_size: int, split_seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) of a data spec, as `selfopd train` splits it (`data.spec`,
    `data.eval_size` distinct held-out prompts, `data.split_seed`)."""
    from selfopd.data import load_examples

    return split_examples(load_examples(spec), eval_size=eval_size, seed=split_seed)
