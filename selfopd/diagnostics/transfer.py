"""Did the teacher's advantage become the student's own, beyond the prompts it trained on?

A privileged teacher knows the answer better than the student: before training, the start
model reading the privileged context gives the reference answer a higher logprob than the
start model without it. Training closes part of that gap on the prompts it trains on, whatever
the information is: even a per-prompt answer can be memorised. Only information the student can
store and reuse closes the gap on prompts it never trained on as well. So, for the reference
answer y of each prompt ("The answer is {answer}.", its answer tokens only):

    closure(split) = sum over prompts of [lp_end(y) - lp_start(y)]
                     / sum over prompts of [lp_teacher(y) - lp_start(y)]

over the prompts where the context helps (lp_teacher > lp_start), lp_start and lp_end the
student without context before and after training, lp_teacher the start model with the
teacher's template. 1: the student now knows what the context told it; 0: nothing of it stayed.
The transfer is closure(held out) / closure(trained). Facts about entities that recur across
prompts transfer (a held-out phrasing of a trained fact); the answer to a fresh problem does
not, unless the student learns to compute it, which is real learning and shows in held-out
accuracy too. Intervals: 95% bootstrap over prompts, each split resampled on its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from selfopd.core.stats import MeanEstimate
from selfopd.data.example import Example
from selfopd.engines.base import Engine

GOLD = "The answer is {answer}."
BOOTSTRAP_SAMPLES = 2000
MIN_GAP = 1e-6  # nats: a context that does not raise the answer's logprob has nothing to transfer


def answer_tokens(tokenizer: Any, text: str, answer: str) -> tuple[list[int], list[bool]]:
    """Token ids of `text` and which of them overlap the last occurrence of `answer` in it."""
    start = text.rindex(answer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [begin < start + len(answer) and end > start for begin, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


@dataclass(frozen=True)
class AnswerLogprobs:
    """The reference answer's logprob (summed over its tokens) under the three views of one prompt."""

    id: str
    teacher: float  # start model, privileged context
    start: float  # start model, the student's prompt
    end: float  # trained model, the student's prompt


def answer_logprobs(examples: Sequence[Example], prompting: Any, teacher: Engine, start: Engine, end: Engine,
                    batch_size: int = 16) -> list[AnswerLogprobs]:
    """Each example's reference answer scored by the three views (`prompting`: a run's
    `selfopd.diagnostics.context.Prompting`)."""
    gold = [answer_tokens(prompting.tokenizer, GOLD.format(answer=e.answer), e.answer) for e in examples]
    student_prompts = [prompting.student_ids(e) for e in examples]
    teacher_prompts = [prompting.teacher_ids(e, GOLD.format(answer=e.answer)) for e in examples]

    def summed(engine: Engine, prompts: list[list[int]]) -> list[float]:
        sums = []
        for first in range(0, len(examples), batch_size):
            pairs = [(p, ids) for p, (ids, _) in zip(prompts[first : first + batch_size], gold[first : first + batch_size])]
            for scores, (_, mask) in zip(engine.score(pairs), gold[first : first + batch_size]):
                sums.append(float(scores.logprobs.double()[np.array(mask)].sum()))
        return sums

    views = summed(teacher, teacher_prompts), summed(start, student_prompts), summed(end, student_prompts)
    return [AnswerLogprobs(e.id, *values) for e, values in zip(examples, zip(*views))]


@dataclass(frozen=True)
class Transfer:
    trained: MeanEstimate  # closure on training prompts (n: those prompts)
    held_out: MeanEstimate  # closure on held-out prompts
    ratio: MeanEstimate  # held_out / trained (n: the held-out prompts)
    skipped: int  # prompts whose context did not raise the answer's logprob


def closure(rows: Sequence[AnswerLogprobs], min_gap: float = MIN_GAP) -> float:
    """Share of the context's advantage on the answer that the trained student has by itself."""
    rows = [r for r in rows if r.teacher - r.start > min_gap]
    gap = sum(r.teacher - r.start for r in rows)
    return sum(r.end - r.start for r in rows) / gap if gap > 0 else float("nan")


class NothingToTransfer(ValueError):
    """No prompt of a split has a gap to close: the measure is undefined there, not zero."""


def transfer(trained: Sequence[AnswerLogprobs], held_out: Sequence[AnswerLogprobs], seed: int = 0,
             min_gap: float = MIN_GAP) -> Transfer:
    """Closure on each split and their ratio, with bootstrap intervals over prompts; a prompt
    counts when its context raises the answer's logprob by more than `min_gap` nats."""
    kept = [[r for r in rows if r.teacher - r.start > min_gap] for rows in (trained, held_out)]
    if not kept[0] or not kept[1]:
        raise NothingToTransfer("no prompt whose privileged context raises the reference answer's logprob in "
                         f"{'the trained' if not kept[0] else 'the held-out'} split: nothing to transfer")
    rng = np.random.default_rng(seed)
    arrays = [np.array([[r.teacher - r.start, r.end - r.start] for r in rows]) for rows in kept]
    draws = []
    for _ in range(BOOTSTRAP_SAMPLES):
        sums = [a[rng.integers(0, len(a), len(a))].sum(0) for a in arrays]
        draws.append([s[1] / s[0] for s in sums])
    draws_ = np.array(draws)
    draws_ = np.column_stack([draws_, draws_[:, 1] / draws_[:, 0]])
    values = [closure(kept[0], min_gap), closure(kept[1], min_gap)]
    values.append(values[1] / values[0])
    ns = [len(kept[0]), len(kept[1]), len(kept[1])]
    estimates = [MeanEstimate(v, *np.percentile(draws_[:, i], [2.5, 97.5]).tolist(), ns[i])
                 for i, v in enumerate(values)]
    return Transfer(*estimates, skipped=len(trained) + len(held_out) - sum(ns[:2]))


TransferRows = tuple[list[AnswerLogprobs], list[AnswerLogprobs]]  # trained, held out


@dataclass(frozen=True)
class MeasuredTransfer:
    """A run's transfer, or why a split had no gap to close (the rest of a diagnosis stands), and
    the per-prompt rows it was computed from."""

    result: Transfer | str
    rows: TransferRows

    def line(self) -> str:
        if isinstance(self.result, str):
            return f"- Transfer of the teacher's advantage on the reference answer: not measured, {self.result}."
        return transfer_line(self.result)

    def save(self, out: Path) -> dict:
        """Write the rows to out/transfer.jsonl; returns the diagnosis summary's entry."""
        from selfopd.diagnostics.measures import as_jsonable

        write_transfer_rows(self.rows, out / "transfer.jsonl")
        return {"not_measured": self.result} if isinstance(self.result, str) else as_jsonable(self.result)


def measure_transfer(config: Any, checkpoint: Any, prompting: Any, teacher: Engine, start: Engine,
                     train_examples: Sequence[Example], eval_examples: Sequence[Example], items: int) -> MeasuredTransfer:
    """A run's transfer from its per-prompt answer logprobs: its teacher and student at the start, its
    `checkpoint` at the end, on a seeded sample of `items` training prompts and its first `items` held-out ones."""
    import random

    from selfopd.engines.build import frozen_engine

    end = frozen_engine(checkpoint, config)
    trained = random.Random(f"{config.data.split_seed}/transfer").sample(list(train_examples), min(items, len(train_examples)))
    held_out = list(eval_examples[:items])
    size = config.eval.batch_size
    rows = (answer_logprobs(trained, prompting, teacher, start, end, size),
            answer_logprobs(held_out, prompting, teacher, start, end, size))
    try:
        return MeasuredTransfer(transfer(*rows), rows)
    except NothingToTransfer as error:
        return MeasuredTransfer(str(error), rows)


def write_transfer_rows(rows: TransferRows, path: Any) -> None:
    """One JSON line per prompt (split, id and the three logprobs): the transfer can be recomputed
    under another rule without scoring again."""
    from selfopd.core.atomic import write_text_atomic

    lines = [json.dumps({"split": split, **dataclasses.asdict(row)})
             for split, part in zip(("trained", "held_out"), rows) for row in part]
    write_text_atomic(path, "".join(line + "\n" for line in lines))


def read_transfer_rows(path: Any) -> TransferRows:
    rows: TransferRows = ([], [])
    for line in open(path).read().splitlines():
        record = json.loads(line)
        rows[record.pop("split") == "held_out"].append(AnswerLogprobs(**record))
    return rows


def transfer_line(t: Transfer) -> str:
    """The report's verdict line."""
    if t.trained.low <= 0:
        return (f"- Transfer of the teacher's advantage on the reference answer: the trained student closed "
                f"**{t.trained}** of the gap its context opened on training prompts (**{t.held_out}** on held-out "
                "ones): no gap reliably closed on the prompts it trained on, so there is no transfer to measure "
                "(the ratio is not read).")
    return (f"- Transfer of the teacher's advantage on the reference answer: the trained student closed "
            f"**{t.trained}** of the gap its context opened on training prompts and **{t.held_out}** on held-out "
            f"ones; held-out / trained **{t.ratio}**. Near 1: the information was learned and is used beyond the "
            "prompts trained on; near 0 with a closed training gap: memorised per prompt, the privileged illusion"
            + (f" ({t.skipped} prompts skipped: the context did not raise the answer's logprob)." if t.skipped else "."))
