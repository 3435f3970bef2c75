"""selfopd.core.plots and selfopd.core.heatmaps: reads metrics.jsonl with gaps, writes valid PNGs, skips plots without data;
per-token heatmaps wrap like text, share one colour scale, and escape HTML."""

from __future__ import annotations

import json
import math
import re

import pytest
from matplotlib.colors import to_rgba
from matplotlib.image import imread

from selfopd.core.heatmaps import (
    ENVIRONMENT_COLOR, LINE_IN, NO_VALUE_COLOR, _layout_tokens, plot_token_heatmap, plot_token_heatmaps_side_by_side,
    save_token_heatmap_html, token_heatmap_html,
)
from selfopd.core.plots import DPI, plot_training_curves, read_metrics
from selfopd.core.run_folder import RunFolderError


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
    with pytest.raises(RunFolderError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(path)


@pytest.mark.parametrize("text, expected", [
    (b'{"step": 1}\n[1, 2]\n', r"metrics\.jsonl:2: not a metrics line \(a JSON object with a whole 'step'\)"),
    (b'{"step": 1}\n{"step": "1"}\n', r"metrics\.jsonl:2: not a metrics line"),
    (b'{"step": 1}\n{"loss": 2}\n', r"metrics\.jsonl:2: not a metrics line"),
    (b'{"step": 1}\n{"step": 2, "x": "\xff"}\n', r"metrics\.jsonl:2: not UTF-8 text \(byte 0xff\); the file was damaged"),
])
def test_read_metrics_refuses_lines_selfopd_does_not_write(tmp_path, text, expected):
    """A non-JSON or altered metrics.jsonl ended `--resume` and `diagnose` in a traceback."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text)
    with pytest.raises(RunFolderError, match=expected):
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


# --- per-token heatmaps -----------------------------------------------------------------

TOKENS = ["Let", " me", " think", ".", "\n", "   ", "3", " +", " 4", " =", " 7", ".\n", "", "The", " answer"]


def unshow(shown: str) -> str:
    """The token text a cell stands for (for tokens not cut short)."""
    return shown.replace("↵", "\n").replace("→", "\t").replace("·", " ")


def test_layout_wraps_at_the_width_and_breaks_after_newlines():
    cells = _layout_tokens(TOKENS, width_chars=10)
    assert "".join(unshow(shown) for _, _, shown in cells) == "".join(TOKENS)
    for line, column, shown in cells:
        assert column + max(1, len(shown)) <= 10
    by_token = dict(zip(TOKENS, cells))
    assert by_token["Let"][:2] == (0, 0) and by_token[" me"][:2] == (0, 3)
    assert by_token[" think"][:2] == (1, 0)  # "Let me think" is 12 characters: wraps
    assert by_token["\n"][2] == "↵" and by_token["   "] == (2, 0, "···")  # newline ended line 1
    assert by_token[".\n"][2] == ".↵" and by_token[""][:2] == (by_token[".\n"][0] + 1, 0)
    assert by_token["The"][:2] == (by_token[""][0], 1)  # the empty token takes one visible cell
    assert by_token[" answer"][:2] == (by_token["The"][0] + 1, 0)


def test_layout_gives_a_too_long_token_its_own_line():
    cells = _layout_tokens(["ab", "x" * 30, "cd"], width_chars=10)
    assert cells == [(0, 0, "ab"), (1, 0, "x" * 9 + "…"), (2, 0, "cd")]


def facecolors(axes):
    return [to_rgba(patch.get_facecolor()) for patch in axes.patches]


def test_cell_colours_follow_the_values():
    values = [1.0, -1.0, 0.0, math.nan, 0.5]
    figure = plot_token_heatmap(["a", " b", " c", " d", " e"], values)
    colours = facecolors(figure.axes[0])
    assert len(colours) == 5  # one cell per token
    positive, negative, zero, missing, half = colours
    assert positive[2] > positive[0] + 0.2 and negative[0] > negative[2] + 0.2  # blue vs red
    assert min(zero[:3]) > 0.9  # white-ish at 0
    assert missing == pytest.approx(to_rgba(NO_VALUE_COLOR))
    assert sum(half[:3]) > sum(positive[:3]) + 0.3  # paler than the largest value at the same sign
    vmax_colours = facecolors(plot_token_heatmap(["a"], [1.0], vmax=10.0).axes[0])
    assert min(vmax_colours[0][:3]) > 0.75  # 1.0 on a scale to 10 is pale


def test_heatmap_writes_png_and_svg_and_grows_taller_with_more_lines(tmp_path):
    short, long = tmp_path / "short.png", tmp_path / "long.png"
    short_figure = plot_token_heatmap(TOKENS, [0.1 * i - 0.7 for i in range(len(TOKENS))], short)
    long_figure = plot_token_heatmap([" word"] * 300, [math.sin(i) for i in range(300)], long)  # 17 lines of 18
    assert {text.get_fontsize() for text in long_figure.axes[0].texts} == {short_figure.axes[0].texts[0].get_fontsize()}
    short_image, long_image = imread(short), imread(long)
    assert short_image[..., :3].std() > 0.05
    assert short_image.shape[1] == long_image.shape[1]  # width set by width_chars
    # 3 lines against 17: taller by 14 lines of LINE_IN inches, not a smaller font.
    assert long_image.shape[0] - short_image.shape[0] == pytest.approx(14 * LINE_IN * DPI, abs=2)
    svg = tmp_path / "rollout.svg"
    plot_token_heatmap(TOKENS, [0.0] * len(TOKENS), svg)
    assert svg.read_text().lstrip().startswith("<?xml") and svg.stat().st_size > 1000


def test_heatmap_rejects_a_length_mismatch_and_an_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="2 values for 3 tokens"):
        plot_token_heatmap(["a", "b", "c"], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"out\.pdf"):
        plot_token_heatmap(["a"], [0.0], tmp_path / "out.pdf")


def test_side_by_side_shares_one_colour_scale():
    tokens = ["x", " y", " z"]
    figure = plot_token_heatmaps_side_by_side(tokens, {"teacher A": [0.5, -2.0, 0.0], "teacher B": [0.5, 0.25, 1.0]})
    panel_a, panel_b = figure.axes[:2]
    assert panel_a.get_title(loc="left") == "teacher A" and panel_b.get_title(loc="left") == "teacher B"
    assert facecolors(panel_a)[0] == facecolors(panel_b)[0]  # same value, same colour
    assert facecolors(panel_b)[2] != facecolors(panel_a)[1]
    # The scale spans +-2 (panel A's largest |value|), so panel B's 1.0 is not the darkest blue.
    alone = plot_token_heatmap(tokens, [0.5, 0.25, 1.0])
    assert facecolors(alone.axes[0])[2] != facecolors(panel_b)[2]
    with pytest.raises(ValueError, match="teacher B"):
        plot_token_heatmaps_side_by_side(tokens, {"teacher A": [0.0] * 3, "teacher B": [0.0] * 2})


def test_html_escapes_tokens_and_shows_values_in_tooltips(tmp_path):
    tokens = ["Hi", " <b>", "\n", "&"]
    fragment = token_heatmap_html(tokens, {"hint": [1.0, -1.0, 0.0, math.nan], "plain": [0.0, 0.0, 0.0, 0.0]},
                                  title="rollout <3>", details={"teacher logprob": [-0.1, -2.5, -0.3, -0.2]})
    assert "<b>" not in fragment and "&lt;b&gt;" in fragment and "&amp;" in fragment
    assert "rollout &lt;3&gt;" in fragment
    assert "↵\n" in fragment and "white-space: pre-wrap" in fragment
    spans = [part for part in fragment.split("<span ") if part.startswith('title="#')]
    assert len(spans) == 2 * len(tokens)  # one span per token per label
    first, second = spans[0], spans[1]
    assert "hint: +1.0000" in first and "plain: +0.0000" in first and "teacher logprob: -0.1000" in first
    assert "hint: -1.0000" in second and "teacher logprob: -2.5000" in second
    background = [part.split("background: ")[1][:7] for part in (first, second)]
    assert background[0] != background[1]
    assert "http" not in fragment and "<script" not in fragment
    page = save_token_heatmap_html(tmp_path / "rollouts.html", fragment, title="rollouts")
    text = page.read_text(encoding="utf-8")
    assert '<meta charset="utf-8">' in text and fragment in text and "<title>rollouts</title>" in text
    with pytest.raises(ValueError, match="teacher logprob"):
        token_heatmap_html(tokens, {"hint": [0.0] * 4}, details={"teacher logprob": [0.0]})


# --- episodes: environment ids greyed, turns marked ------------------------------------------

EPISODE_TOKENS = ["I", " think", " 5", ".", "<|im_end|>", "\n", "user", "\nWrong", ", try", " again", ".\n", "assistant\n",
                  "It", " is", " 7", "."]
EPISODE_MASK = [True] * 4 + [False] * 8 + [True] * 4
MASK_CHANGES = [0, 4, 12]  # where each turn starts: "turn 1", "environment", "turn 2"


def episode_values(environment_value: float) -> list[float]:
    student = iter([0.4, -0.2, 1.0, 0.0, -0.6, 0.3, 0.8, -1.0])
    return [next(student) if own else environment_value for own in EPISODE_MASK]


def cell_data(figure) -> list:
    """Everything drawn in a heatmap's panels: cells, texts, lines, and the figure's size."""
    data = []
    for axes in figure.axes:
        data.append([(tuple(patch.get_xy()), patch.get_width(), to_rgba(patch.get_facecolor())) for patch in axes.patches])
        data.append([(text.get_text(), text.get_position(), str(text.get_color())) for text in axes.texts])
        data.append([line.get_xydata().tolist() for line in axes.lines])
    return data + [tuple(figure.get_size_inches())]


def test_a_rollout_without_a_mask_draws_as_before_episodes_existed():
    """The HTML of a fixed rollout, byte for byte as before episodes were drawn (its digest), and a mask of
    the student's ids only (an episode of one answer) draws the same figure and HTML as no mask."""
    import hashlib

    tokens = TOKENS + [" <b>&"]
    values = [0.1 * i - 0.7 for i in range(len(tokens))]
    values[3] = math.nan
    html = token_heatmap_html(tokens, {"a": values, "b": [v * 0.5 for v in values]}, title="t",
                              details={"d": [1.0] * len(tokens)})
    assert hashlib.sha256(html.encode()).hexdigest() == "e6c8c2cf3956754a1df52ea9bfda03f42b4d8ee1492440cf46889e06a8d1f435"
    assert token_heatmap_html(tokens, {"a": values, "b": [v * 0.5 for v in values]}, title="t",
                              details={"d": [1.0] * len(tokens)}, students=[True] * len(tokens)) == html
    plain = plot_token_heatmaps_side_by_side(tokens, {"a": values, "b": [1.0] * len(tokens)}, width_chars=12)
    masked = plot_token_heatmaps_side_by_side(tokens, {"a": values, "b": [1.0] * len(tokens)}, width_chars=12,
                                              students=[True] * len(tokens))
    assert cell_data(plain) == cell_data(masked)
    assert not any(text.get_text() in ("turn 1", "environment") for text in plain.axes[0].texts)


def test_environment_ids_are_grey_whatever_their_value_and_stay_out_of_the_scale():
    calm = plot_token_heatmap(EPISODE_TOKENS, episode_values(0.0), students=EPISODE_MASK)
    wild = plot_token_heatmap(EPISODE_TOKENS, episode_values(-1e6), students=EPISODE_MASK)
    for figure in (calm, wild):
        colours = facecolors(figure.axes[0])
        assert [c for c, own in zip(colours, EPISODE_MASK) if not own] == [to_rgba(ENVIRONMENT_COLOR)] * 8
        assert all(c != to_rgba(ENVIRONMENT_COLOR) for c, own in zip(colours, EPISODE_MASK) if own)
    assert facecolors(calm.axes[0]) == facecolors(wild.axes[0])  # the -1e6 stretched no scale
    assert cell_data(calm) == cell_data(wild)
    unmasked = facecolors(plot_token_heatmap(EPISODE_TOKENS, episode_values(-1e6)).axes[0])
    assert unmasked[4] != to_rgba(ENVIRONMENT_COLOR)  # without the mask the same id is coloured by its value

    html = token_heatmap_html(EPISODE_TOKENS, {"adv": episode_values(-1e6)}, students=EPISODE_MASK,
                              details={"teacher logprob": episode_values(-5e5)})
    spans = [part for part in html.split("<span ") if part.startswith('title="#')]
    assert len(spans) == len(EPISODE_TOKENS)
    for span, own in zip(spans, EPISODE_MASK):
        assert (f"background: {ENVIRONMENT_COLOR}" in span) is (not own)
        assert not any(shown in span for shown in ("e+06", "e+05", "1000000", "500000"))  # no environment value shown
    assert "environment (not trained)" in spans[4] and "adv: +1.0000" in spans[2]
    assert html == token_heatmap_html(EPISODE_TOKENS, {"adv": episode_values(0.0)}, students=EPISODE_MASK,
                                      details={"teacher logprob": episode_values(0.0)})


def test_turn_marks_sit_exactly_at_the_mask_changes():
    figure = plot_token_heatmap(EPISODE_TOKENS, episode_values(0.0), students=EPISODE_MASK, width_chars=30)
    axes = figure.axes[0]
    cells = [(patch.get_xy()[0], patch.get_xy()[1] - 0.08) for patch in axes.patches]  # (column, line) per token
    marks = [(text.get_text(), text.get_position()) for text in axes.texts
             if text.get_text() in ("turn 1", "turn 2", "environment")]
    assert [label for label, _ in marks] == ["turn 1", "environment", "turn 2"]
    for (label, (x, y)), index in zip(marks, MASK_CHANGES):
        column, line = cells[index]
        assert y - 0.5 == pytest.approx(line) and x < column  # on the line the turn starts, left of its first token
        assert column == pytest.approx(len(label) + 1)  # the turn's first token follows its label
        assert index == 0 or cells[index - 1][1] < line  # each turn starts a line of its own
    rules = sorted(line.get_xydata()[0][1] for line in axes.lines)
    assert rules == [cells[4][1], cells[12][1]]  # a rule above every turn but the first

    html = token_heatmap_html(EPISODE_TOKENS, {"adv": episode_values(0.0)}, students=EPISODE_MASK)
    body = html.split("white-space: pre-wrap")[1]
    order = ["mark" if part.startswith('class="turn"') else "token" for part in body.split("<span ")[1:]]
    marked = [order[:i].count("token") for i, kind in enumerate(order) if kind == "mark"]
    assert marked == MASK_CHANGES and order.count("token") == len(EPISODE_TOKENS)
    assert re.findall(r'class="turn"[^>]*>([^<]*)<', body) == ["turn 1", "environment", "turn 2"]


def test_a_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="students has 3 values for 16 tokens"):
        plot_token_heatmap(EPISODE_TOKENS, episode_values(0.0), students=[True, False, True])
    with pytest.raises(ValueError, match="students has 3 values for 16 tokens"):
        token_heatmap_html(EPISODE_TOKENS, {"adv": episode_values(0.0)}, students=[True, False, True])
