"""The per-token heatmaps of `selfopd diagnose`: the most telling rollouts of a step as PNGs and in
heatmaps.html, and one rollout under the correct and a wrong context. An episode's environment ids
are greyed and its turns labelled (`selfopd.core.heatmaps`, given the rollout's loss mask)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from selfopd.diagnostics.measures import Annotated


def write_step_heatmaps(annotated: Mapping[int, Sequence[Annotated]], steps: Sequence[int], folder: Path,
                        count: int) -> dict[str, str]:
    """`count` PNGs per step under `folder`; returns {key: path relative to folder's parent}."""
    from selfopd.core.heatmaps import plot_token_heatmap

    figures = {}
    for step in steps:
        for rank, rollout in enumerate(telling_rollouts(annotated[step], count)):
            key = f"heatmap_step{step}_{rank}"
            plot_token_heatmap(rollout.pieces.pieces, rollout.advantage, folder / f"{key}.png",
                               title=f"step {step}: {rollout_title(rollout)}", label="teacher - student logprob (nats)",
                               students=rollout.record.loss_mask)
            figures[key] = f"{folder.name}/{key}.png"
    return figures


def write_contrast_heatmap(rollouts: Sequence[Annotated], gains_wrong: Sequence[np.ndarray], path: Path) -> None:
    """The most telling rollout's privileged gain with the correct and with a wrong context, side by side."""
    from selfopd.core.heatmaps import plot_token_heatmaps_side_by_side

    rollout = telling_rollouts(rollouts, 1)[0]
    plot_token_heatmaps_side_by_side(
        rollout.pieces.pieces,
        {"correct context": rollout.advantage, "wrong context": gains_wrong[list(rollouts).index(rollout)]},
        path, title=f"Privileged gain, same rollout: {rollout_title(rollout)}", students=rollout.record.loss_mask)


def write_heatmaps_html(annotated: Mapping[int, Sequence[Annotated]], steps: Sequence[int], count: int, path: Path,
                        title: str) -> None:
    """`count` rollouts per step in one HTML page, with the teacher's and student's logprobs on hover."""
    from selfopd.core.heatmaps import save_token_heatmap_html, token_heatmap_html

    blocks = [
        token_heatmap_html(rollout.pieces.pieces, {"teacher - student": rollout.advantage},
                           title=f"step {step}: {rollout_title(rollout)}",
                           details={"teacher logprob": rollout.record.teacher_logprobs,
                                    "student logprob": rollout.record.student_logprobs},
                           students=rollout.record.loss_mask)
        for step in steps for rollout in telling_rollouts(annotated[step], count)
    ]
    save_token_heatmap_html(path, "\n".join(blocks), title=title)


def telling_rollouts(rollouts: Sequence[Annotated], count: int) -> list[Annotated]:
    """Rollouts worth looking at first: alternately the correct one and the wrong one with
    the largest total |advantage| (what the teacher most wants changed), then the rest."""
    ranked = sorted(rollouts, key=lambda r: -float(np.abs(r.advantage).sum()))
    correct = [r for r in ranked if r.record.correct]
    wrong = [r for r in ranked if not r.record.correct]
    chosen = []
    while (correct or wrong) and len(chosen) < count:
        for pool in (wrong, correct):
            if pool and len(chosen) < count:
                chosen.append(pool.pop(0))
    return chosen


def rollout_title(rollout: Annotated) -> str:
    record = rollout.record
    verdict = "correct" if record.correct else "wrong"
    return f"item {record.id} ({verdict}, reference {record.answer!s:.20}), sum of advantage {rollout.advantage.sum():+.2f}"
