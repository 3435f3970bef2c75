"""Training curves of one run, from its `metrics.jsonl`, as PNGs for reports and issues, and
the figure helpers every selfopd figure shares (per-token heatmaps: `selfopd.core.heatmaps`).

Figures are built with matplotlib's object API on an Agg canvas, never through pyplot:
no display is needed, no backend is switched for the importing process (a notebook keeps
its own), and no figure stays registered in pyplot's global list between calls.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from selfopd.core.atomic import replace_atomic

DPI = 120
STYLE = {"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 11, "legend.fontsize": 10}
MARKERS_BELOW = 60  # series with fewer points get markers, so a lone point is visible


def read_metrics(path: Path) -> list[dict]:
    """One dict per line of `path`; keys absent on a line stay absent (eval runs every N steps).

    An unterminated last line that does not parse is skipped: it is a line the trainer is
    still writing, so a run can be plotted while it trains. Any other line that is not a JSON
    object with a whole "step" (an altered or damaged file) raises RunFolderError naming file and line.
    """
    from selfopd.core.run_folder import RunFolderError

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        line = Path(path).read_bytes()[:error.start].count(b"\n") + 1
        raise RunFolderError(f"{path}:{line}: not UTF-8 text (byte 0x{error.object[error.start]:02x}); the file was "
                             "damaged or altered: move it aside, or restore it") from None
    lines = text.split("\n")
    metrics = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the last piece after the final newline: partially written
                continue
            raise RunFolderError(f"{path}:{number}: not a JSON line: {error}; the file was damaged or altered: move it "
                                 "aside, or restore it") from None
        if not (isinstance(value, dict) and type(value.get("step")) is int and value["step"] >= 0):
            raise RunFolderError(f"{path}:{number}: not a metrics line (a JSON object with a whole 'step'); the file "
                                 "was damaged or altered: move it aside, or restore it")
        metrics.append(value)
    return metrics


def plot_training_curves(metrics: list[dict], out_dir: Path, title: str = "") -> list[Path]:
    """Write loss.png, kl.png, accuracy.png and curves.png (all as panels) to `out_dir`.

    A plot whose metrics never appear is skipped; returns the paths written, in that order.
    """
    out_dir = Path(out_dir)
    panels = [(name, draw) for name, (keys, draw) in PANELS.items() if any(_series(metrics, key)[0] for key in keys)]
    if not panels:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context(STYLE):
        for name, draw in panels:
            figure = new_figure(1, title)
            draw(figure.axes[0], metrics)
            written.append(save_figure(figure, out_dir / f"{name}.png"))
        figure = new_figure(len(panels), title)
        for axes, (_, draw) in zip(figure.axes, panels):
            draw(axes, metrics)
        written.append(save_figure(figure, out_dir / "curves.png"))
    return written


def _series(metrics: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the lines that have both `step` and `key`, sorted by step."""
    points = sorted((m["step"], m[key]) for m in metrics if m.get(key) is not None and m.get("step") is not None)
    return [s for s, _ in points], [v for _, v in points]


def _draw_loss(axes: Axes, metrics: list[dict]) -> None:
    steps, values = _series(metrics, "loss/pg")
    _line(axes, steps, values, color="tab:blue")
    decorate(axes, "Policy-gradient loss", "loss/pg")


def _draw_kl(axes: Axes, metrics: list[dict]) -> None:
    steps, values = _series(metrics, "opd/reverse_kl")
    _line(axes, steps, values, color="tab:red")
    # A sampled-token estimate: single steps can dip below zero, the true KL cannot.
    axes.axhline(0.0, color="0.5", linewidth=0.8, linestyle=":")
    decorate(axes, "Reverse KL to teacher (estimate)", "nats / token")


def _draw_accuracy(axes: Axes, metrics: list[dict]) -> None:
    steps, values = _series(metrics, "reward/mean")
    if steps:
        _line(axes, steps, values, color="tab:gray", alpha=0.7, label="training samples (reward/mean)")
    rows = sorted(
        (m["step"], m["eval/accuracy"], m.get("eval/ci_low"), m.get("eval/ci_high"))
        for m in metrics
        if m.get("eval/accuracy") is not None and m.get("step") is not None
    )
    if rows:
        steps = [row[0] for row in rows]
        accuracy = [row[1] for row in rows]
        # Error bars, not a band: evals are sparse, and a band would suggest values between them.
        low = [max(0.0, a - lo) if lo is not None else 0.0 for _, a, lo, _ in rows]
        high = [max(0.0, hi - a) if hi is not None else 0.0 for _, a, _, hi in rows]
        axes.errorbar(steps, accuracy, yerr=[low, high], color="tab:green", marker="o", markersize=5, capsize=4,
                      linewidth=1.8, label="held-out eval (95% interval)")
    values = [v for line in axes.get_lines() for v in line.get_ydata() if math.isfinite(v)]
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        axes.set_ylim(-0.03, 1.03)
    axes.legend(loc="best")
    decorate(axes, "Accuracy", "accuracy")


def _line(axes: Axes, steps: list[float], values: list[float], **style) -> None:
    marker = "o" if len(steps) < MARKERS_BELOW else None
    axes.plot(steps, values, marker=marker, markersize=3.5, linewidth=1.5, **style)


def decorate(axes: Axes, title: str, ylabel: str, xlabel: str = "step") -> None:
    """Title, labels and a light grid; integer ticks when x counts steps."""
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if xlabel == "step":
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, alpha=0.3)


def new_figure(panels: int, title: str) -> Figure:
    """A row of `panels` axes on an Agg canvas (no pyplot state)."""
    figure = Figure(figsize=(5.5 * panels, 4.2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.subplots(1, panels, squeeze=False)
    if title:
        figure.suptitle(title, fontsize=14)
    return figure


def save_figure(figure: Figure, path: Path) -> Path:
    """Write the figure at the toolkit's DPI, whole or not at all; returns the path."""
    path = Path(path)
    return replace_atomic(path, lambda temporary: figure.savefig(temporary, dpi=DPI, format=path.suffix[1:] or None))


# file stem -> (metric keys, any of which makes the plot worth drawing; drawing function)
PANELS: dict[str, tuple[tuple[str, ...], Callable[[Axes, list[dict]], None]]] = {
    "loss": (("loss/pg",), _draw_loss),
    "kl": (("opd/reverse_kl",), _draw_kl),
    "accuracy": (("eval/accuracy", "reward/mean"), _draw_accuracy),
}
