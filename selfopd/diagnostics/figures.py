"""Diagnostic figures: where the advantage sits by token class, and how the student's
outputs and the illusion score move over training. Same drawing rules as `selfopd.core.plots`
(object API on an Agg canvas, never pyplot)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib
import numpy as np

from selfopd.diagnostics.measures import ClassRow, IllusionScore, StepBehaviour
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from selfopd.core.plots import DPI, STYLE, decorate, save_figure

def plot_class_shares(decompositions: dict[str, Sequence[ClassRow]], path: Path, title: str = "") -> Path:
    """For each labelled decomposition (e.g. first vs last step, or two templates): each
    class's share of the total |advantage| (bars, with 95% intervals), and its share of
    tokens (a black line across the bar). A bar far above its line is where the teacher teaches."""
    labels = list(decompositions)
    names = [row.name for row in next(iter(decompositions.values()))]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(min(13.0, 3.0 + 0.9 * len(names) * len(labels)), 4.6), dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        if title:
            figure.suptitle(title, fontsize=14)
        width = 0.8 / len(labels)
        x = np.arange(len(names))
        for index, label in enumerate(labels):
            rows = decompositions[label]
            offset = x - 0.4 + width * (index + 0.5)
            shares = np.nan_to_num([r.abs_share.value for r in rows])
            errors = np.nan_to_num([[r.abs_share.value - r.abs_share.low for r in rows],
                                    [r.abs_share.high - r.abs_share.value for r in rows]]).clip(min=0)
            axes.bar(offset, shares, width * 0.9, yerr=errors, capsize=3, color=f"C{index}", alpha=0.8, label=label)
            axes.hlines([r.token_share for r in rows], offset - width * 0.45, offset + width * 0.45, color="black",
                        linewidth=2, label="share of tokens" if index == 0 else None)
            for xi, share, high in zip(offset, shares, np.nan_to_num([r.abs_share.high for r in rows])):
                axes.text(xi, max(share, high) + 0.015, f"{share:.2f}", ha="center", va="bottom", fontsize=9)
        axes.set_xticks(x, [n.replace("_", " ") for n in names])
        axes.set_ylim(0, 1.1)
        axes.set_ylabel("share of total |advantage|")
        axes.set_title("Where the teacher's |advantage| sits, by token class")
        axes.grid(True, axis="y", alpha=0.3)
        axes.legend(loc="upper left", fontsize=9)
        return save_figure(figure, Path(path))


def plot_behaviour(behaviour: Sequence[StepBehaviour], illusion: dict[int, IllusionScore], path: Path,
                   title: str = "") -> Path:
    """Four panels over training steps: illusion score (with its 95% interval and the
    warning threshold), response length, epistemic words per 100 tokens, and the shares of
    outputs the verifier accepts, that run into the token cap, and that refer to or copy
    privileged context."""
    steps = [b.step for b in behaviour]
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(11, 7.6), dpi=DPI, layout="constrained")  # 2 x 2: readable in a README
        FigureCanvasAgg(figure)
        axes = figure.subplots(2, 2).ravel()
        if title:
            figure.suptitle(title, fontsize=14)
        illusion_steps = sorted(illusion)
        values = [illusion[s].share.value for s in illusion_steps]
        axes[0].fill_between(illusion_steps, [illusion[s].share.low for s in illusion_steps],
                             [illusion[s].share.high for s in illusion_steps], color="tab:red", alpha=0.2)
        axes[0].plot(illusion_steps, values, color="tab:red", marker="o", markersize=3.5)
        if illusion_steps:  # the threshold follows the answer tokens' share of each step's tokens
            axes[0].plot(illusion_steps, [illusion[s].threshold for s in illusion_steps], color="0.3",
                         linestyle="--", linewidth=1, label=f"warning: {illusion[illusion_steps[0]].lift_threshold}x "
                         "the answer tokens' share")
            axes[0].legend(loc="best")
        axes[0].set_ylim(0, 1)
        decorate(axes[0], "Illusion score", "answer tokens' share of |adv|")
        axes[1].fill_between(steps, [b.length.low for b in behaviour], [b.length.high for b in behaviour],
                             color="tab:blue", alpha=0.2)
        axes[1].plot(steps, [b.length.value for b in behaviour], color="tab:blue", marker="o", markersize=3.5)
        decorate(axes[1], "Response length", "tokens")
        axes[2].plot(steps, [b.epistemic_per_100 for b in behaviour], color="tab:purple", marker="o", markersize=3.5)
        decorate(axes[2], "Epistemic words", "per 100 tokens")
        axes[3].plot(steps, [b.leak_rate for b in behaviour], color="tab:orange", marker="o", markersize=3.5,
                     label="refers to / copies context")
        axes[3].plot(steps, [b.accuracy for b in behaviour], color="tab:green", marker="o", markersize=3.5,
                     alpha=0.6, label="verifier accepts")
        axes[3].plot(steps, [b.at_cap for b in behaviour], color="tab:gray", marker="o", markersize=3.5,
                     linestyle=":", label="at the token cap")
        axes[3].set_ylim(-0.03, 1.03)
        axes[3].legend(loc="best")
        decorate(axes[3], "Student outputs", "share of rollouts")
        return save_figure(figure, Path(path))
