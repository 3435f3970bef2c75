"""The learnability part of `selfopd diagnose`: teachability, the contrastive gain and the
DOPD information/capability split (`selfopd.diagnostics.signals`) on the first saved step's
rollouts, with the run's starting weights at its rollout temperature (as training scores),
as a report section, summary numbers, heatmaps and RUN/diagnostics/signals.jsonl."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from selfopd.core.atomic import write_lines_atomic
from selfopd.diagnostics.context import Prompting, annotate_records
from selfopd.diagnostics.measures import Annotated, ClassRow, Share, as_jsonable, decompose
from selfopd.run.rollouts import RolloutRecord
from selfopd.diagnostics.signals import (
    DopdSplit,
    Teachability,
    contrastive_gains,
    dopd_split,
    information_by_class,
    prompt_mean,
    teachability,
)
from selfopd.engines.base import Engine
from selfopd.core.stats import MeanEstimate

TOP_K = 5  # the student's candidates per position for teachability
HEATMAP_ROLLOUTS = 8  # rollouts in signals.html

# What the DOPD split is for a teacher made of the student's own weights, measured (as here)
# with the run's starting weights.
SELF_WEIGHT_NOTES = {
    "self": "self teacher: all information (capability 0): the teacher is the student's own weights with the "
            "privileged context, at every step",
    "frozen": "frozen teacher: the initial weights, which are the student's at the start, so here it is all "
              "information (capability 0); as the student trains, the capability part becomes the difference "
              "between the initial and the trained weights (what training changed, not what a stronger model knows)",
    "ema": "EMA teacher: a moving average of the student, equal to it at the start, so here it is all information "
           "(capability 0); later the capability part is the average's lag behind the student",
}


@dataclass(frozen=True)
class SignalDiagnosis:
    """The per-token signals of one step's rollouts, and their summaries over prompts."""

    step: int
    teacher_kind: str
    temperature: float
    rollouts: list[Annotated]  # advantage = teacher - student at `temperature`, starting weights
    teachability: list[Teachability]
    gains: list[np.ndarray]  # contrastive gain: true minus another item's context, per token
    splits: list[DopdSplit]
    mass: MeanEstimate  # teacher mass on the student's top-k, per token, averaged over prompts
    tail: MeanEstimate
    gain: MeanEstimate
    gain_classes: list[ClassRow]  # the contrastive gain by token class (`decompose`)
    information: dict[str, Share] | None  # DOPD information share by class; None for a self-weights teacher

    @property
    def exact(self) -> bool:
        return all(t.exact for t in self.teachability)


def measure_signals(student: Engine, teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting,
                    teacher_kind: str, temperature: float, batch_size: int = 16) -> SignalDiagnosis:
    """`teacher` is `student` for a teacher of the student's own (starting) weights."""
    splits = dopd_split(student, teacher, records, prompting, temperature, batch_size)
    taught = teachability(student, teacher, records, prompting, TOP_K, temperature=temperature, batch_size=batch_size)
    gains = contrastive_gains(teacher, records, prompting, temperature, batch_size)
    rollouts = [dataclasses.replace(a, advantage=s.advantage) for a, s in zip(annotate_records(records, prompting),
                                                                              splits)]
    gain_rollouts = [dataclasses.replace(a, advantage=g) for a, g in zip(rollouts, gains)]
    return SignalDiagnosis(
        records[0].step, teacher_kind, temperature, rollouts, taught, gains, splits,
        prompt_mean(records, [t.mass for t in taught]), prompt_mean(records, [t.tail for t in taught]),
        prompt_mean(records, gains), decompose(gain_rollouts),
        information_by_class(rollouts, splits) if teacher_kind == "external" else None,
    )


def signals_json(d: SignalDiagnosis) -> dict[str, Any]:
    """summary.json's "signals" entry."""
    return {"step": d.step, "temperature": d.temperature, "top_k": TOP_K, "exact": d.exact,
            "teacher_mass_on_student_top_k": as_jsonable(d.mass), "tail_mass": as_jsonable(d.tail),
            "contrastive_gain": as_jsonable(d.gain), "contrastive_gain_by_class": as_jsonable(d.gain_classes),
            "dopd_information_share": as_jsonable(d.information),
            "dopd_note": SELF_WEIGHT_NOTES.get(d.teacher_kind) if d.information is None else None}


def write_signal_outputs(d: SignalDiagnosis, out: Path) -> dict[str, str]:
    """out/signals.jsonl (every scored rollout), out/figures/signals.png (one rollout, side by
    side) and out/signals.html; returns the figure's {key: path relative to out}."""
    from selfopd.core.heatmaps import plot_token_heatmaps_side_by_side, save_token_heatmap_html, token_heatmap_html

    write_lines_atomic(out / "signals.jsonl", (_rollout_json(d, i) for i in range(len(d.rollouts))))
    ranked = sorted(range(len(d.rollouts)), key=lambda i: -float(np.abs(d.rollouts[i].advantage).sum()))
    first = ranked[0]
    plot_token_heatmaps_side_by_side(d.rollouts[first].pieces.pieces, _panels(d, first), out / "figures" / "signals.png",
                                     title=f"step {d.step}, item {d.rollouts[first].record.id}: per-token signals",
                                     label="nats (tail mass: probability)", students=d.rollouts[first].record.loss_mask)
    blocks = [token_heatmap_html(d.rollouts[i].pieces.pieces, _panels(d, i), title=f"item {d.rollouts[i].record.id}",
                                 details={"teacher mass on student top-k": d.teachability[i].mass},
                                 students=d.rollouts[i].record.loss_mask)
              for i in ranked[:HEATMAP_ROLLOUTS]]
    save_token_heatmap_html(out / "signals.html", "\n".join(blocks), title=f"step {d.step}: per-token signals")
    return {"signals": "figures/signals.png"}


def _panels(d: SignalDiagnosis, index: int) -> dict[str, np.ndarray]:
    split = d.splits[index]
    return {"advantage (teacher - student)": split.advantage, "information": split.information,
            "capability": split.capability, "contrastive gain": d.gains[index], "tail mass": d.teachability[index].tail}


def _rollout_json(d: SignalDiagnosis, index: int) -> dict[str, Any]:
    rollout, split = d.rollouts[index], d.splits[index]
    record = rollout.record
    return {"id": record.id, "step": record.step, "prompt": record.prompt, "correct": record.correct,
            "text": record.text, "tokens": rollout.pieces.pieces, "classes": rollout.classes,
            "advantage": split.advantage.tolist(), "information": split.information.tolist(),
            "capability": split.capability.tolist(), "contrastive_gain": d.gains[index].tolist(),
            "teacher_mass": d.teachability[index].mass.tolist(), "tail_mass": d.teachability[index].tail.tolist()}


def render_signals(d: SignalDiagnosis, figures: dict[str, str]) -> str:
    bound = "exact, from the teacher's full distribution" if d.exact else "a lower bound, from the teacher's top-J"
    lines = [
        f"## Teachability, contrastive gain, information vs capability (rollouts of step {d.step}, starting "
        f"weights, temperature {d.temperature:g})",
        "",
        f"- Teachability: the teacher's probability mass on the student's own top-{TOP_K} tokens, per token: "
        f"**{d.mass}** ({bound}); tail mass (on tokens the student does not consider) **{d.tail}**. Mass on the "
        "student's candidates is disagreement it can learn by reweighting; tail mass asks for what it cannot yet "
        "produce (TA-OPD's learnable vs incompatible disagreement).",
        f"- Contrastive gain, log p_T(token | this item's context) - log p_T(token | another item's context), mean per "
        f"token: **{_signed_estimate(d.gain)}**. What the teacher's score owes to this item's context, not to having "
        "a context of that shape (CREDIT's baseline); where it sits:",
        "",
        "| class | tokens | share of \\|contrastive gain\\| | mean gain |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r.name} | {r.token_share:.1%} | {r.abs_share} | {_signed(r.mean)} |" for r in d.gain_classes]
    lines += ["", "DOPD split of the advantage: information = log p_S(y | x, c) - log p_S(y | x) (the student given the "
              "same context), capability = log p_T(y | x, c) - log p_S(y | x, c); they sum to teacher - student.", ""]
    if d.information is None:
        lines.append(f"- {SELF_WEIGHT_NOTES.get(d.teacher_kind, 'a teacher of the student weights: all information')}.")
    else:
        lines += ["| tokens | information share of \\|information\\| + \\|capability\\| | capability share |",
                  "|---|---:|---:|"]
        lines += [f"| {name} | {s} | {1 - s.value:.3f} [{1 - s.high:.3f}, {1 - s.low:.3f}] |"
                  for name, s in d.information.items()]
        lines += ["", "A high information share on answer tokens is the privilege illusion seen by DOPD: the teacher's "
                  "advantage there is what the context tells, which the student cannot reach without it."]
    lines += ["", f"![signals]({figures['signals']})", "",
              "Every scored rollout's per-token signals: signals.jsonl; interactive: [signals.html](signals.html)."]
    return "\n".join(lines)


def _signed(value: float) -> str:
    return f"{value:+.3f}" if math.isfinite(value) else "n/a"


def _signed_estimate(m: MeanEstimate) -> str:
    return f"{m.value:+.3f} [{m.low:+.3f}, {m.high:+.3f}] (n={m.n} {m.unit})"
