"""selfopd.plots: reads metrics.jsonl with gaps, writes valid PNGs, skips plots without data."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from selfopd.plots import plot_training_curves, read_metrics


def synthetic_metrics(steps: int = 20, eval_every: int = 5) -> list[dict]:
    """A run's lines: loss missing on some steps, eval keys only every `eval_every` steps."""
    metrics = []
    for step in range(1, steps + 1):
        line = {"step": step, "opd/reverse_kl": 0.5 / step - 0.01, "reward/mean": min(1.0, 0.2 + 0.03 * step)}
        if step % 7:
            line["loss/pg"] = 0.1 * (-1) ** step / step
        if step % eval_every == 0:
            accuracy = min(0.85, 0.25 + 0.02 * step)
            line |= {"eval/accuracy": accuracy, "eval/ci_low": accuracy - 0.1, "eval/ci_high": accuracy + 0.08}
        metrics.append(line)
    return metrics


def test_read_metrics_keeps_gaps_and_skips_a_partly_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(m) for m in synthetic_metrics(steps=5)]
    path.write_text("\n".join(lines) + "\n\n" + '{"step": 6, "loss/p')
    metrics = read_metrics(path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert "eval/accuracy" not in metrics[0] and metrics[4]["eval/accuracy"] == pytest.approx(0.35)


def test_read_metrics_names_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(path)


def test_writes_all_plots_as_valid_pngs(tmp_path):
    written = plot_training_curves(synthetic_metrics(), tmp_path / "plots", title="toy run")
    names = ["loss.png", "kl.png", "accuracy.png", "curves.png"]
    assert [p.name for p in written] == names
    shapes = {}
    for path in written:
        image = imread(path)  # raises on a file that is not a PNG
        assert image.ndim == 3 and image.shape[2] in (3, 4)
        assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas
        shapes[path.name] = image.shape[:2]
    height, width = shapes["loss.png"]
    assert height >= 400 and width >= 600  # ~5.5 x 4.2 in at 120 dpi
    assert shapes["curves.png"][1] > 2.5 * width  # three panels side by side


def test_skips_plots_whose_metrics_are_absent(tmp_path):
    only_loss = [{"step": s, "loss/pg": 1.0 / s} for s in range(1, 4)] + [{"step": 4}]
    written = plot_training_curves(only_loss, tmp_path)
    assert [p.name for p in written] == ["loss.png", "curves.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "loss.png"]


def test_accuracy_plot_from_training_reward_alone_and_nothing_from_empty_metrics(tmp_path):
    written = plot_training_curves([{"step": 1, "reward/mean": 0.5}], tmp_path / "reward")
    assert [p.name for p in written] == ["accuracy.png", "curves.png"]
    assert plot_training_curves([{"step": 1}], tmp_path / "empty") == []
    assert not (tmp_path / "empty").exists()


def test_accuracy_plot_takes_an_interval_that_ends_at_the_value(tmp_path):
    # An eval of 0/25 whose lower bound is (within rounding) the value itself.
    evals = [{"step": 0, "eval/accuracy": 0.0, "eval/ci_low": 1e-18, "eval/ci_high": 0.13},
             {"step": 2, "eval/accuracy": 1.0, "eval/ci_low": 0.87, "eval/ci_high": 1.0 - 1e-16}]
    written = plot_training_curves(evals, tmp_path)
    assert [p.name for p in written] == ["accuracy.png", "curves.png"]
