"""Per-token heatmaps of a rollout (PNG, SVG or HTML): where in a rollout the teacher
disagrees with the student. For an episode (`students`: its loss mask), the environment's ids are
greyed, never coloured by a value, and each turn starts a line labelled "turn k" or "environment".

Figures are built with matplotlib's object API on an Agg canvas, never through pyplot (see
`selfopd.core.plots`).
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, Normalize, to_hex, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from selfopd.core.atomic import write_text_atomic
from selfopd.core.plots import DPI, save_figure
from selfopd.core.turns import is_episode, segments

# ---------------------------------------------------------------------------------------
# Tokens are laid out like monospace text, on a grid whose x unit is one character and
# whose y unit is one line, so a figure's size follows from the width in characters and
# the number of lines: a long rollout makes a taller figure, never a smaller font.
#
# In a notebook, a returned Figure displays inline only once IPython's matplotlib
# integration is on (`%matplotlib inline`, or pyplot imported somewhere); matplotlib's
# Figure has no `_repr_png_` of its own. Otherwise display the saved file with
# `IPython.display.Image(path)`.
# ---------------------------------------------------------------------------------------

HEATMAP_CMAP = "RdBu"  # diverging: negative red, 0 (near) white, positive blue
NO_VALUE_COLOR = "#cfcfcf"  # light grey for nan: a token without a value
CELL_FONT = {"family": "DejaVu Sans Mono", "size": 10.5}  # advance 0.602 em = 0.088 in per char
CHAR_IN = 0.1  # inches per character cell: the glyph plus a little room
LINE_IN = 0.3  # inches per line of tokens
SHOWN = {"\n": "↵", "\t": "→"}  # drawn in place of characters that would be invisible or move the pen
SPACE_SHOWN = "·"  # a space in a whitespace-only token, so the token gets a visible cell
ENVIRONMENT_COLOR = "#ececec"  # an episode's environment ids: context, never trained, so never coloured by a value
ENVIRONMENT_TEXT = "#7a7a7a"
MARK_FONT = {"family": "DejaVu Sans", "size": 9, "style": "italic"}  # "turn k" / "environment" at a turn's start
MARK_COLOR = "#444444"


def _shown_text(token: str) -> str:
    """What a cell shows: newlines and tabs as arrows; spaces as dots if the token is only whitespace."""
    shown = "".join(SHOWN.get(char, char) for char in token)
    if token and not token.strip():
        shown = shown.replace(" ", SPACE_SHOWN)
    return shown


def _cell_width(shown: str) -> int:
    """Width of a cell in characters; an empty token still gets one, so it can be seen."""
    return max(1, len(shown))


def _layout_tokens(tokens: Sequence[str], width_chars: int) -> list[tuple[int, int, str]]:
    """(line, column, shown text) of each token, wrapping lines like monospace text.

    A token goes to a new line when it would pass `width_chars`; a token holding a newline
    ends its line; a token wider than a line gets a line of its own, cut short with "…".
    """
    return _layout(tokens, width_chars, {})[0]


def _layout(tokens: Sequence[str], width_chars: int,
            marks: Mapping[int, str]) -> tuple[list[tuple[int, int, str]], dict[int, int]]:
    """`_layout_tokens`, with each token index of `marks` starting a new line behind its label:
    the cells, and the line each label is drawn on."""
    if width_chars < 2:
        raise ValueError(f"width_chars must be at least 2, got {width_chars}")
    cells, mark_lines = [], {}
    line, column = 0, 0
    for index, token in enumerate(tokens):
        if index in marks:
            if column > 0:
                line, column = line + 1, 0
            mark_lines[index] = line
            column = min(len(marks[index]) + 1, width_chars)
        shown = _shown_text(token)
        if len(shown) > width_chars:
            shown = shown[: width_chars - 1] + "…"
        if column > 0 and column + _cell_width(shown) > width_chars:
            line, column = line + 1, 0
        cells.append((line, column, shown))
        column += _cell_width(shown)
        if "\n" in token:
            line, column = line + 1, 0
    return cells, mark_lines


def _turn_marks(students: Sequence[bool] | None, n_tokens: int) -> dict[int, str]:
    """{token index: label} where each turn of an episode starts; {} for a single answer."""
    if students is None:
        return {}
    if len(students) != n_tokens:
        raise ValueError(f"students has {len(students)} values for {n_tokens} tokens: one per token expected")
    return {segment.start: segment.label for segment in segments(students)} if is_episode(students) else {}


def _as_values(values: Sequence[float | None], n_tokens: int, name: str) -> list[float]:
    """`values` as floats (None becomes nan), after checking there is one per token."""
    if len(values) != n_tokens:
        raise ValueError(f"{name} has {len(values)} values for {n_tokens} tokens: one value per token expected")
    return [math.nan if v is None else float(v) for v in values]


def _color_limit(series: Iterable[Sequence[float]], vmax: float | None) -> float:
    """Half-width of the symmetric colour scale: `vmax`, else the largest |finite value|, else 1."""
    if vmax is not None:
        if not (math.isfinite(vmax) and vmax > 0):
            raise ValueError(f"vmax must be a positive finite number, got {vmax}")
        return float(vmax)
    largest = max((abs(v) for values in series for v in values if math.isfinite(v)), default=0.0)
    return largest if largest > 0 else 1.0


def _cell_color(value: float, norm: Normalize, cmap: Colormap, own: bool = True) -> tuple[float, float, float, float]:
    if not own:
        return to_rgba(ENVIRONMENT_COLOR)
    return to_rgba(NO_VALUE_COLOR) if not math.isfinite(value) else cmap(norm(value))


def _students_only(series: Mapping[str, list[float]], students: Sequence[bool] | None) -> list[list[float]]:
    """Each series' values at the student's ids: what the colour scale is fitted to."""
    if students is None:
        return list(series.values())
    return [[v for v, own in zip(values, students) if own] for values in series.values()]


def _text_color(face: tuple[float, ...]) -> str:
    """Black on light cells, white on dark ones (relative luminance of the cell)."""
    red, green, blue = face[:3]
    return "white" if 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.45 else "black"


def _draw_tokens(axes: Axes, cells: list[tuple[int, int, str]], values: list[float], norm: Normalize,
                 cmap: Colormap, students: Sequence[bool] | None = None) -> None:
    """One rectangle per token, in token order, with the token's text centred in it; an
    environment id (`students` False) greyed whatever its value."""
    owns = students if students is not None else [True] * len(cells)
    for (line, column, shown), value, own in zip(cells, values, owns):
        face = _cell_color(value, norm, cmap, own)
        width = _cell_width(shown)
        axes.add_patch(Rectangle((column, line + 0.08), width, 0.84, facecolor=face, edgecolor="0.55",
                                 linewidth=0.5))
        # parse_math=False: a "$" in a token is text, not the start of a formula.
        axes.text(column + width / 2, line + 0.5, shown, ha="center", va="center_baseline",
                  color=_text_color(face) if own else ENVIRONMENT_TEXT, parse_math=False, fontdict=CELL_FONT)


def _draw_marks(axes: Axes, marks: Mapping[int, str], mark_lines: Mapping[int, int], width_chars: int) -> None:
    """Each turn's label at the start of its first line, and a dashed rule above every turn but the first."""
    for index, label in marks.items():
        line = mark_lines[index]
        if line > 0:
            axes.plot([0, width_chars], [line, line], color="0.45", linewidth=0.8, linestyle="--")
        axes.text(0.1, line + 0.5, label, ha="left", va="center_baseline", color=MARK_COLOR, parse_math=False,
                  fontdict=MARK_FONT)


def _heatmap_figure(panels: int, lines: int, width_chars: int, title: str,
                    panel_titles: bool) -> tuple[Figure, list[Axes], Axes]:
    """A figure sized in inches from the grid: title, colour bar, then the token panels side by side.

    Axes are placed by hand (not constrained layout) so one character is exactly CHAR_IN wide.
    """
    margin, gap = 0.2, 0.4
    title_in = 0.45 if title else 0.1
    scale_in = 0.75  # colour bar with its label and ticks above it
    panel_title_in = 0.3 if panel_titles else 0.05
    panel_w = width_chars * CHAR_IN
    panel_h = lines * LINE_IN
    width = 2 * margin + panels * panel_w + (panels - 1) * gap
    height = title_in + scale_in + panel_title_in + panel_h + margin
    figure = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title, fontsize=13, y=1 - 0.1 / height, va="top")
    panel_axes = []  # added first, so figure.axes lists the panels before the colour bar
    for index in range(panels):
        left = margin + index * (panel_w + gap)
        axes = figure.add_axes([left / width, margin / height, panel_w / width, panel_h / height])
        axes.set_xlim(0, width_chars)
        axes.set_ylim(lines, 0)  # line 0 at the top
        axes.set_axis_off()
        panel_axes.append(axes)
    bar_w = min(4.0, width - 2 * margin)
    bar_top = height - title_in - 0.45
    colorbar_axes = figure.add_axes([(width - bar_w) / 2 / width, (bar_top - 0.14) / height, bar_w / width,
                                     0.14 / height])
    return figure, panel_axes, colorbar_axes


def _draw_colorbar(figure: Figure, axes: Axes, norm: Normalize, cmap: Colormap, label: str,
                   any_missing: bool, episode: bool = False) -> None:
    colorbar = figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=axes, orientation="horizontal")
    colorbar.set_label(label, fontsize=10)
    colorbar.ax.xaxis.set_ticks_position("top")
    colorbar.ax.xaxis.set_label_position("top")
    colorbar.ax.tick_params(labelsize=9)
    if any_missing:
        axes.text(1.03, 0.5, "grey: no value", transform=axes.transAxes, va="center", fontsize=9,
                  bbox={"facecolor": NO_VALUE_COLOR, "edgecolor": "0.55", "linewidth": 0.5})
    if episode:
        axes.text(-0.03, 0.5, "environment (not trained)", transform=axes.transAxes, va="center", ha="right",
                  fontsize=9, color=ENVIRONMENT_TEXT,
                  bbox={"facecolor": ENVIRONMENT_COLOR, "edgecolor": "0.55", "linewidth": 0.5})


def _image_format(path: str | Path) -> str:
    """"png" or "svg", from the suffix; checked before drawing, so a bad path fails fast."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".png", ".svg"):
        raise ValueError(f"{path}: can only save a heatmap as .png or .svg")
    return suffix[1:]


def plot_token_heatmap(tokens: Sequence[str], values: Sequence[float], path: str | Path | None = None, *,
                       title: str = "", label: str = "advantage (nats)", vmax: float | None = None,
                       width_chars: int = 90, students: Sequence[bool] | None = None) -> Figure:
    """A rollout's text with each token coloured by its value (e.g. per-token advantage).

    Shows where in a completion the teacher pulls the student up (blue) or down (red);
    nan values are grey. The scale is symmetric around 0: `vmax`, else the largest |value|.
    `students` (an episode's loss mask, `RolloutRecord.students`): the environment's ids are greyed
    and left out of the scale, and each turn starts a labelled line. Saves to `path` (.png or .svg)
    if given; returns the Figure either way.
    """
    return plot_token_heatmaps_side_by_side(tokens, {"": values}, path, title=title, label=label, vmax=vmax,
                                            width_chars=width_chars, students=students)


def plot_token_heatmaps_side_by_side(tokens: Sequence[str], values_by_label: Mapping[str, Sequence[float]],
                                     path: str | Path | None = None, *, title: str = "",
                                     label: str = "advantage (nats)", vmax: float | None = None,
                                     width_chars: int = 60, students: Sequence[bool] | None = None) -> Figure:
    """The same rollout under several teachers or templates, one panel per label, one shared colour scale.

    One scale, so a colour means the same value in every panel and the panels can be compared cell by cell.
    `students` as in `plot_token_heatmap`.
    """
    if path is not None:
        _image_format(path)  # checked before drawing, so a bad path fails fast
    if not values_by_label:
        raise ValueError("values_by_label is empty: give at least one series of values")
    series = {name: _as_values(values, len(tokens), f"values for {name!r}" if name else "values")
              for name, values in values_by_label.items()}
    marks = _turn_marks(students, len(tokens))
    limit = _color_limit(_students_only(series, students), vmax)
    norm, cmap = Normalize(-limit, limit), matplotlib.colormaps[HEATMAP_CMAP]
    cells, mark_lines = _layout(tokens, width_chars, marks)
    lines = cells[-1][0] + 1 if cells else 1
    panel_titles = any(name for name in series)
    figure, panels, colorbar_axes = _heatmap_figure(len(series), lines, width_chars, title, panel_titles)
    for axes, (name, values) in zip(panels, series.items()):
        _draw_tokens(axes, cells, values, norm, cmap, students)
        _draw_marks(axes, marks, mark_lines, width_chars)
        if name:
            axes.set_title(name, fontsize=11, loc="left")
    any_missing = any(not math.isfinite(v) for values in _students_only(series, students) for v in values)
    _draw_colorbar(figure, colorbar_axes, norm, cmap, label, any_missing, episode=bool(marks))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_figure(figure, Path(path))
    return figure


def token_heatmap_html(tokens: Sequence[str], values_by_label: Mapping[str, Sequence[float]], *, title: str = "",
                       vmax: float | None = None, details: Mapping[str, Sequence[float]] | None = None,
                       students: Sequence[bool] | None = None) -> str:
    """An HTML fragment of the rollout, one block per label, tokens coloured on the PNGs' scale.

    For browsing many rollouts: text can be searched and copied, and hovering a token shows
    its repr, its value under every label and each `details` series (e.g. teacher and
    student logprob) at that position. `students` (an episode's loss mask): the environment's
    ids are greyed and show no values, and each turn starts a labelled line. Inline CSS only,
    no scripts, no external resources.
    """
    if not values_by_label:
        raise ValueError("values_by_label is empty: give at least one series of values")
    series = {name: _as_values(values, len(tokens), f"values for {name!r}") for name, values in values_by_label.items()}
    extra = {name: _as_values(values, len(tokens), f"details {name!r}") for name, values in (details or {}).items()}
    marks = _turn_marks(students, len(tokens))
    owns = list(students) if students is not None else [True] * len(tokens)
    limit = _color_limit(_students_only(series, students), vmax)
    norm, cmap = Normalize(-limit, limit), matplotlib.colormaps[HEATMAP_CMAP]
    tooltips = [_tooltip(index, token, series | extra) if own else _environment_tooltip(index, token)
                for index, (token, own) in enumerate(zip(tokens, owns))]
    parts = ['<div style="font-family: sans-serif; font-size: 14px;">']
    if title:
        parts.append(f"<h3 style=\"margin: 0.3em 0;\">{escape(title)}</h3>")
    parts.append(_html_legend(limit, norm, cmap, episode=bool(marks)))
    for name, values in series.items():
        spans = "".join((_html_mark(marks[index], index > 0) if index in marks else "")
                        + _html_span(token, value, tooltip, norm, cmap, own)
                        for index, (token, value, tooltip, own) in enumerate(zip(tokens, values, tooltips, owns)))
        parts.append(f"<div style=\"margin-top: 0.8em; font-weight: bold;\">{escape(name)}</div>")
        parts.append('<div style="font-family: \'DejaVu Sans Mono\', monospace; white-space: pre-wrap; '
                     f'line-height: 1.7; border: 1px solid #ccc; padding: 0.4em;">{spans}</div>')
    parts.append("</div>")
    return "\n".join(parts)


def _tooltip(index: int, token: str, series: Mapping[str, list[float]]) -> str:
    """Hover text of one token: its position and repr, then one `name: value` line per series."""
    lines = [f"#{index} {token!r}"] + [f"{name}: {values[index]:+.4f}" for name, values in series.items()]
    return "\n".join(lines)


def _environment_tooltip(index: int, token: str) -> str:
    """Hover text of an environment id: no values, they are context and never trained."""
    return f"#{index} {token!r}\nenvironment (not trained)"


def _html_span(token: str, value: float, tooltip: str, norm: Normalize, cmap: Colormap, own: bool = True) -> str:
    face = _cell_color(value, norm, cmap, own)
    text = escape(token).replace("\n", "↵\n")  # the arrow is coloured, the newline breaks the line
    color = _text_color(face) if own else ENVIRONMENT_TEXT
    return (f'<span title="{escape(tooltip)}" style="background: {to_hex(face)}; color: {color}; '
            f'border-right: 1px solid #fff;">{text}</span>')


def _html_mark(label: str, ruled: bool) -> str:
    """A turn's label on a line of its own, ruled off from the turn before (`ruled`)."""
    rule = "border-top: 1px dashed #999; " if ruled else ""
    return (f'<span class="turn" style="display: block; margin-top: 0.3em; {rule}'
            f'font-family: sans-serif; font-size: 11px; font-style: italic; color: {MARK_COLOR};">'
            f'{escape(label)}</span>')


def _html_legend(limit: float, norm: Normalize, cmap: Colormap, episode: bool = False) -> str:
    """Swatches at -limit, -limit/2, 0, limit/2, limit, one for a missing value, and one for an
    episode's environment ids."""
    swatches = []
    for value in (-limit, -limit / 2, 0.0, limit / 2, limit, math.nan):
        face = _cell_color(value, norm, cmap)
        text = "no value" if math.isnan(value) else f"{value:+.2f}"
        swatches.append(f'<span style="background: {to_hex(face)}; color: {_text_color(face)}; padding: 0.1em 0.5em; '
                        f'border: 1px solid #999; margin-right: 0.2em;">{text}</span>')
    if episode:
        swatches.append(f'<span style="background: {ENVIRONMENT_COLOR}; color: {ENVIRONMENT_TEXT}; padding: 0.1em 0.5em; '
                        'border: 1px solid #999; margin-right: 0.2em;">environment (not trained)</span>')
    return f"<div>scale (shared by all blocks): {''.join(swatches)}</div>"


def save_token_heatmap_html(path: str | Path, html: str, title: str) -> Path:
    """Write the `html` fragment (from `token_heatmap_html`) as a full UTF-8 page a browser opens directly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    page = (f"<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n<title>{escape(title)}</title>\n"
            f"</head>\n<body>\n{html}\n</body>\n</html>\n")
    return write_text_atomic(path, page)
