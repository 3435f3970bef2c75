"""Per-turn statistics of a run whose rollouts are episodes (`rollout.environment`): how many turns
the student takes, and what the teacher's signal is on each turn's tokens. Only the student's ids are
measured; the environment's are counted as a share of the completion and nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from selfopd.core.stats import MeanEstimate, mean_interval
from selfopd.core.turns import segments
from selfopd.diagnostics.measures import Annotated, Share, as_jsonable, ratio_share


@dataclass(frozen=True)
class TurnRow:
    """The student's k-th turn over the episodes that reached it."""

    turn: int
    episodes: int  # episodes with a k-th student turn
    ended: int  # of them, episodes whose last student turn is this one
    ended_correct: int  # of those, episodes the verifier accepted
    tokens: int  # the student's tokens in this turn, over all those episodes
    opd: Share  # teacher - student logprob per token of this turn (a ratio of sums, interval over prompts)
    advantage: Share  # the advantage the loss used per token of this turn (OPD plus any reward term)
    abs_share: float  # this turn's share of the episodes' total |teacher - student|


@dataclass(frozen=True)
class EpisodeStats:
    """One step's episodes: turns per episode, the environment's share of the ids, and each turn."""

    episodes: int
    turns: MeanEstimate  # student turns per episode
    environment_share: float  # the environment's ids / all completion ids (context, never trained)
    rows: list[TurnRow]


def is_episode_run(rollouts: Sequence[Annotated]) -> bool:
    """True when the rollouts were sampled as episodes (they carry a loss mask)."""
    return any(r.record.loss_mask is not None for r in rollouts)


def episode_stats(rollouts: Sequence[Annotated]) -> EpisodeStats:
    """Per-turn statistics of one step's episodes (`Annotated.advantage`: teacher - student)."""
    if not rollouts:
        raise ValueError("no rollouts to measure")
    turns_of = [[s for s in segments(r.record.students) if s.student] for r in rollouts]
    total_abs = sum(float(np.abs(r.advantage).sum()) for r in rollouts)
    rows = []
    for turn in range(1, max(len(t) for t in turns_of) + 1):
        reached = [(r, t[turn - 1], len(t) == turn) for r, t in zip(rollouts, turns_of) if len(t) >= turn]
        parts = [r.advantage[s.start:s.end] for r, s, _ in reached]  # teacher - student on this turn's ids
        loss = [float(np.sum(r.record.advantage[s.start:s.end])) for r, s, _ in reached]
        counts = [s.end - s.start for _, s, _ in reached]
        where = [r.record.prompt for r, _, _ in reached]
        turn_abs = sum(float(np.abs(part).sum()) for part in parts)
        rows.append(TurnRow(
            turn, len(reached), sum(last for _, _, last in reached),
            sum(last and r.record.correct for r, _, last in reached), sum(counts),
            ratio_share([float(part.sum()) for part in parts], counts, where), ratio_share(loss, counts, where),
            turn_abs / total_abs if total_abs else float("nan"),
        ))
    ids = sum(len(r.record.completion_ids) for r in rollouts)
    environment = sum(len(r.record.completion_ids) - r.student_tokens for r in rollouts)
    return EpisodeStats(len(rollouts), mean_interval([float(len(t)) for t in turns_of], unit_range=False, unit="rollouts"),
                        environment / ids if ids else float("nan"), rows)


def run_episodes(annotated: Mapping[int, Sequence[Annotated]]) -> dict[int, EpisodeStats]:
    """Per-turn statistics of the first and last saved step of a run whose rollouts are episodes; {} otherwise."""
    if not any(is_episode_run(rollouts) for rollouts in annotated.values()):
        return {}
    return {step: episode_stats(annotated[step]) for step in sorted({min(annotated), max(annotated)})}


def episodes_json(stats: EpisodeStats) -> dict[str, Any]:
    """summary.json's entry for one step's episodes."""
    return as_jsonable(stats)


def render_episodes(episodes: Mapping[int, EpisodeStats]) -> str:
    """The report's section on the episodes: turns per episode and a per-turn table of each reported step."""
    lines = ["## Turns of the episodes", "",
             "The rollouts are episodes: the student's turns with the environment's messages between them. Every "
             "number of this report is over the student's own tokens; the environment's ids are context, never "
             "trained, and left out. In the heatmaps each turn starts a line labelled `turn k` or `environment`, "
             "and the environment's ids are grey.", ""]
    for step, e in episodes.items():
        lines.append(f"- Step {step}: {e.episodes} episodes, {e.turns.value:.2f} [{e.turns.low:.2f}, {e.turns.high:.2f}] "
                     f"student turns per episode; the environment's ids are {_percent(e.environment_share)} of the "
                     "completion ids.")
    lines += ["", "| step | turn | episodes reaching it | ending on it (correct) | student tokens | "
              "teacher - student per token | advantage per token | share of \\|teacher - student\\| |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for step, e in episodes.items():
        for row in e.rows:
            lines.append(f"| {step} | {row.turn} | {row.episodes} | {row.ended} ({row.ended_correct}) | {row.tokens} | "
                         f"{_signed(row.opd)} | {_signed(row.advantage)} | {_percent(row.abs_share)} |")
    return "\n".join(lines)


def _signed(share: Share) -> str:
    """A signed mean per token with its interval (a `Share`: a sum of values over a count of tokens)."""
    return f"{share.value:+.3f} [{share.low:+.3f}, {share.high:+.3f}]" if math.isfinite(share.value) else "n/a"


def _percent(value: float) -> str:
    return f"{value:.0%}" if math.isfinite(value) else "n/a"
