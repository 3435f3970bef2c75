"""The rollouts a run keeps per step (`runs/NAME/rollouts/step_N.jsonl`), written by the
trainer and read back by diagnostics and notebooks: one format, in one place. An archive of
a comparison's records (`selfopd.comparisons.records`) keeps them as one digest per run
(`rollouts/digest.jsonl`): every field but the per-token logprobs and advantages."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from selfopd.core.atomic import write_lines_atomic
from selfopd.core.run_folder import RunFolder


class DiagnosticsError(ValueError):
    """Saved rollouts that cannot be read or matched to the run's data; names the file or item."""


class NonFiniteRecord(DiagnosticsError):
    """A saved logprob, advantage or reward that is not a finite number; names the file and line."""


PER_TOKEN = ("sampler_logprobs", "student_logprobs", "teacher_logprobs", "advantage")  # per completion token: what a digest leaves out


@dataclass(frozen=True)
class RolloutRecord:
    """One student rollout and how the teacher judged each of its tokens.

    Lists are per completion token. `student_logprobs` are the trainer's (the weights that
    were updated), `sampler_logprobs` the sampling engine's; `advantage` is the per-token
    advantage the loss used (OPD term plus any verifier-reward term). For a `self` teacher,
    `teacher_logprobs - student_logprobs` is exactly the privileged gain of that step.
    """

    step: int
    id: str
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    sampler_logprobs: list[float]
    student_logprobs: list[float]
    teacher_logprobs: list[float]
    advantage: list[float]
    reward: float
    correct: bool
    answer: str
    demonstration: str | None = None  # the sibling demonstration the teacher saw; None: none (or files saved before)
    weight_version: int | None = None  # the step whose weights sampled it (rollout.max_staleness); None: files saved before
    # Sampled across weight pushes (several requests in flight): the newest weights that may have sampled a token of it.
    last_weight_version: int | None = None
    # Why a teacher with its own tokenizer could not read the completion (it got no teacher signal,
    # and teacher_logprobs are the sampler's); None: it could, or the teacher reads the student's ids.
    unaligned: str | None = None
    teacher: str | None = None  # the teacher that scored it, in a run with [teachers.NAME]; None: the only one
    # An episode: per completion id, True where the student wrote it, False for the environment's ids (context,
    # never trained: their student_logprobs and advantage are 0). None: a single answer, every id the student's.
    loss_mask: list[bool] | None = None

    def __post_init__(self) -> None:
        length = len(self.completion_ids)
        for name in PER_TOKEN:
            if len(getattr(self, name)) != length:
                raise ValueError(
                    f"rollout {self.id!r} at step {self.step}: {name} has {len(getattr(self, name))} values "
                    f"for {length} completion tokens"
                )
        if self.loss_mask is not None and len(self.loss_mask) != length:
            raise ValueError(f"rollout {self.id!r} at step {self.step}: loss_mask has {len(self.loss_mask)} values "
                             f"for {length} completion tokens")

    @property
    def students(self) -> list[bool]:
        """Per completion token: the student wrote it (an episode's environment ids: False)."""
        return [True] * len(self.completion_ids) if self.loss_mask is None else list(self.loss_mask)

    @property
    def prompt(self) -> str:
        """The prompt's identity, for intervals over prompts: a key of the exact prompt ids
        the student saw (the same prompt in two steps, or under two ids, is one prompt)."""
        return prompt_key(self.prompt_ids)

    @property
    def opd_advantage(self) -> list[float]:
        """teacher - student logprob per token: the distillation signal alone (0 on an episode's
        environment ids, which are never trained)."""
        return [t - s if own else 0.0 for t, s, own in zip(self.teacher_logprobs, self.student_logprobs, self.students)]

    @property
    def opd_mean(self) -> float:
        """The distillation signal's mean over the student's own tokens of the completion."""
        own = [a for a, mine in zip(self.opd_advantage, self.students) if mine]
        return sum(own) / len(own)


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A key of the exact prompt ids (`RolloutRecord.prompt`)."""
    import hashlib

    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


DIGEST = "digest.jsonl"  # in RUN/rollouts/, beside (or instead of) the step files


@dataclass(frozen=True)
class RolloutDigest:
    """A saved rollout without its per-token logprobs and advantages (PER_TOKEN): its ids,
    text, reward and verdict, and `opd_mean`, the one number a comparison's report reads of the
    per-token values (`correct_preference`). Those values come back only by training the run again."""

    step: int
    id: str
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    reward: float
    correct: bool
    answer: str
    opd_mean: float
    demonstration: str | None = None
    weight_version: int | None = None
    last_weight_version: int | None = None
    unaligned: str | None = None
    teacher: str | None = None  # the teacher that scored it, in a run with [teachers.NAME]; None: the only one
    # An episode: per completion id, True where the student wrote it, False for the environment's ids (context,
    # never trained: their student_logprobs and advantage are 0). None: a single answer, every id the student's.
    loss_mask: list[bool] | None = None

    @property
    def prompt(self) -> str:
        return prompt_key(self.prompt_ids)

    @classmethod
    def of(cls, record: RolloutRecord) -> RolloutDigest:
        kept = {key: value for key, value in asdict(record).items() if key not in PER_TOKEN}
        return cls(**kept, opd_mean=record.opd_mean)


def rollout_digest_lines(run_dir: Path) -> str | None:
    """RUN/rollouts/digest.jsonl's text for every saved step of the run, in step order; None when
    the run saved no rollouts or a step file is not in the current format (keep it whole then)."""
    try:
        by_step = read_run_rollouts(run_dir)
    except (FileNotFoundError, DiagnosticsError):
        return None
    return "".join(json.dumps(written(asdict(RolloutDigest.of(record)))) + "\n"
                   for records in by_step.values() for record in records)


def read_rollout_digest(run_dir: Path) -> list[RolloutDigest]:
    """The digests of a run restored from an archive of records; [] when it has none."""
    path = RunFolder(run_dir).rollouts / DIGEST
    if not path.is_file():
        return []
    return [RolloutDigest(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def write_records(path: Path, records: Iterable[RolloutRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(path, (written(asdict(record)) for record in records))


WRITTEN_WHEN_SET = ("unaligned", "teacher", "last_weight_version", "loss_mask")  # fields most runs never set: left out of their files, which stay as they were


def written(fields: dict) -> dict:
    """A record's fields as a file holds them: those of WRITTEN_WHEN_SET only when set."""
    return {key: value for key, value in fields.items() if value is not None or key not in WRITTEN_WHEN_SET}


def read_records(path: Path) -> list[RolloutRecord]:
    """Records of one step file; a bad line, or a number in it that is not finite, is an error
    naming the file and line."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = RolloutRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError, ValueError) as error:
            raise DiagnosticsError(
                f"{path}:{number}: not a rollout record ({error}); runs saved before selfopd kept "
                "student logprobs and advantages cannot be diagnosed from their files"
            ) from None
        _check_numbers(record, f"{path}:{number}")
        records.append(record)
    return records


def _check_numbers(record: RolloutRecord, where: str) -> None:
    """Every token id of a saved record is a token id, and every per-token value and the reward a
    finite number: one NaN would make every mean and interval of a diagnosis NaN, and say nothing
    of where it came from; an id past 2^31 stops a tokenizer with a traceback."""
    for name in ("prompt_ids", "completion_ids"):
        for index, value in enumerate(getattr(record, name)):
            if type(value) is not int or not 0 <= value < 2**31:
                raise DiagnosticsError(f"{where}: rollout {record.id!r} (step {record.step}): {name}[{index}] is "
                                       f"{value!r}, not a token id; the file was altered or is not a rollouts file")
    values = [(f"{name}[{index}]", value) for name in PER_TOKEN for index, value in enumerate(getattr(record, name))]
    for label, value in [*values, ("reward", record.reward)]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise NonFiniteRecord(
                f"{where}: rollout {record.id!r} (step {record.step}): {label} is {value!r}, not a finite number, "
                "in a step the trainer did not skip (metrics.jsonl): the file was altered. Move that step's file "
                "out of rollouts/ to diagnose the others")


def read_run_rollouts(run_dir: Path, steps: Sequence[int] | None = None) -> dict[int, list[RolloutRecord]]:
    """{step: records} of every saved step of a run (or only `steps`), in step order."""
    run = RunFolder(run_dir)
    folder = run.rollouts
    found = {step: run.rollouts_file(step) for step in run.rollout_steps()}
    if not found:
        if (folder / DIGEST).is_file():
            raise FileNotFoundError(f"{folder}: no saved rollouts, only their digest ({DIGEST}: a run restored from an "
                                    "archive of records, which keeps no per-token values); train the run again for them")
        raise FileNotFoundError(f"{folder}: no saved rollouts (the run needs run.rollouts_to_save > 0)")
    if steps is not None:
        missing = sorted(set(steps) - set(found))
        if missing:
            raise FileNotFoundError(f"{folder}: no rollouts saved for step(s) {missing}; saved: {sorted(found)}")
        found = {step: found[step] for step in steps}
    skipped = _skipped_steps(run)
    records: dict[int, list[RolloutRecord]] = {}
    for step, path in sorted(found.items()):
        try:
            records[step] = read_records(path)
        except NonFiniteRecord:
            if step not in skipped:
                raise
            print(f"selfopd: warning: {path}: step {step} left out: the trainer skipped it (metrics.jsonl: a loss or "
                  "gradient that was not finite) and its saved rollouts hold values that are not finite numbers",
                  file=sys.stderr)
    if not records:
        raise DiagnosticsError(f"{folder}: every saved step was skipped by the trainer (a loss or gradient that was "
                               "not finite): nothing to diagnose")
    return records


def _skipped_steps(run: RunFolder) -> set[int]:
    """Steps whose metrics line says the trainer skipped them (a NaN or inf loss or gradient): their
    saved rollouts may hold the non-finite values that caused it."""
    if not run.metrics.is_file():
        return set()
    steps = set()
    for line in run.metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("skipped") and type(row.get("step")) is int:
            steps.add(row["step"])
    return steps
