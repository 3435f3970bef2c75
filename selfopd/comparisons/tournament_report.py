"""What `selfopd prompts rank` prints and writes: one table (stdout and rank.md) and every
number with its interval in rank.json."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.diagnostics.measures import Share, as_jsonable
from selfopd.comparisons.tournament import RULE, TemplateScore, Tournament
from selfopd.core.stats import MeanEstimate

COLUMNS = ("rank", "template", "prefers correct [95% CI] (prompts)", "gap [95% CI]", "illusion [95% CI]", "lift",
           "teachability [95% CI]", "tail", "contrastive gain / token [95% CI]", "mean advantage / token [95% CI]")


def summary_line(tournament: Tournament) -> str:
    s = tournament.settings
    return (f"{tournament.rollouts} rollouts ({tournament.prompts} distinct prompts x {s['samples']} samples, "
            f"T={s['temperature']}, {s['max_tokens']} tokens, seed {s['seed']}), {tournament.correct} correct; "
            f"teacher: {s['teacher_kind']} ({s['teacher_model']}); gap on {tournament.gap_prompts} distinct "
            f"held-out prompts (greedy, {s['gap_max_tokens']} tokens)")


def table_rows(tournament: Tournament) -> list[list[str]]:
    return [[str(rank), score.template, _preference(score), _gap(score), _share(score.illusion.share),
             _lift(score), _interval(score.teachability, signed=False), f"{score.tail.value:.3f}",
             _interval(score.contrastive, signed=True), _share(score.mean_advantage, signed=True)]
            for rank, score in enumerate(tournament.ranked, start=1)]


def render_table(tournament: Tournament) -> str:
    """Plain-text table, columns padded to their widest cell."""
    rows = [list(COLUMNS), *table_rows(tournament)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render_markdown(tournament: Tournament) -> str:
    rows = table_rows(tournament)
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(f"`{c}`" if i == 1 else c for i, c in enumerate(row)) + " |" for row in rows]
    return "\n".join([
        "# Template tournament", "", summary_line(tournament) + ".", "",
        f"Predicted order (pre-registered rule): {RULE}.", "", *table, "",
        "Intervals: 95%, over distinct prompts (the gap's over distinct held-out prompts, paired). "
        "prefers correct: per prompt with both right and wrong samples, the correct samples' mean teacher - "
        "student logprob per token minus the wrong ones'. gap: greedy accuracy of the teacher with the context "
        "minus the student's. illusion: share of |advantage| on answer tokens; lift: that share over their "
        "share of tokens. teachability: the teacher's probability mass on the student's top-{k} tokens at "
        "each position (tail: the mass outside them). contrastive gain: log p_T(y | this item's context) - "
        "log p_T(y | another item's context). Both per token, averaged per rollout, then per prompt. mean "
        "advantage: teacher - student logprob per token over all tokens (the sampled reverse-KL estimate, "
        "negated).".format(k=tournament.settings["top_k"]), "",
    ])


def tournament_json(tournament: Tournament) -> dict[str, Any]:
    return {
        "settings": tournament.settings, "rule": RULE, "distinct_prompts": tournament.prompts,
        "rollouts": tournament.rollouts, "correct_rollouts": tournament.correct,
        "gap_distinct_prompts": tournament.gap_prompts,
        "ranked": [_score_json(rank, score) for rank, score in enumerate(tournament.ranked, start=1)],
    }


def write_tournament(tournament: Tournament, out: Path) -> tuple[Path, Path]:
    """out/rank.json and out/rank.md, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    return (write_json_atomic(out / "rank.json", tournament_json(tournament)),
            write_text_atomic(out / "rank.md", render_markdown(tournament)))


def _score_json(rank: int, score: TemplateScore) -> dict[str, Any]:
    illusion = score.illusion
    return {
        "rank": rank, "template": score.template, "rank_value": score.rank_value, "all_zero": score.all_zero,
        "teacher_prefers_correct": as_jsonable(score.preference), "gap": as_jsonable(score.gap),
        "illusion": {"share": as_jsonable(illusion.share), "answer_token_share": as_jsonable(illusion.token_share),
                     "lift": as_jsonable(illusion.lift), "warning": illusion.warning},
        "teachability": as_jsonable(score.teachability), "tail": as_jsonable(score.tail),
        "contrastive_gain_per_token": as_jsonable(score.contrastive),
        "mean_advantage_per_token": as_jsonable(score.mean_advantage),
    }


def _preference(score: TemplateScore) -> str:
    p = score.preference
    if p is None:
        return "0 (all advantage 0)" if score.all_zero else "undefined (no mixed prompt)"
    return f"{_interval(p, signed=True)} ({p.n})"


def _gap(score: TemplateScore) -> str:
    g = score.gap.gap
    return f"{g.mean:+.3f} [{g.low:+.3f}, {g.high:+.3f}]"


def _share(share: Share, signed: bool = False) -> str:
    if not math.isfinite(share.value):
        return "undefined"
    return _interval(share, signed)


def _lift(score: TemplateScore) -> str:
    lift = score.illusion.lift
    if not math.isfinite(lift) or not math.isfinite(score.illusion.share.value):
        return ""
    return f"{lift:.1f}x" + (" (warns)" if score.illusion.warning else "")


def _interval(value: Share | MeanEstimate, signed: bool) -> str:
    f = "+.3f" if signed else ".3f"
    return f"{value.value:{f}} [{value.low:{f}}, {value.high:{f}}]"
