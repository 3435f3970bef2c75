"""`selfopd diagnose RUN_DIR` (`measure_run`, then `write_report`): where a run's teacher signal came from.

From the saved rollouts alone: the |advantage| decomposition by token class, the illusion score per step,
and length, epistemic words and leakage over training. With a model (the run's starting weights, the
default): on the first saved step, the wrong-context contrast, teachability, the contrastive gain and
the DOPD split (`signals_report`); and the accuracy gap the privileged context opens before training.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from selfopd.config import teacher_tables
from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.diagnostics.context import (ContextGap, Prompting, annotate_records, context_gap, privileged_gains,
                                         run_prompting)
from selfopd.diagnostics.episodes import EpisodeStats, episodes_json, render_episodes, run_episodes
from selfopd.diagnostics.report_heatmaps import write_contrast_heatmap, write_heatmaps_html, write_step_heatmaps
from selfopd.diagnostics.measures import (Annotated, ClassRow, ContextContrast, IllusionScore, StepBehaviour,
                                          as_jsonable, collapse_warnings, context_contrast, correct_preference,
                                          decompose, illusion_score, step_behaviour)
from selfopd.run.rollouts import DiagnosticsError, RolloutRecord, read_run_rollouts
from selfopd.diagnostics.teachers import one_teachers_part
from selfopd.diagnostics.transfer import MeasuredTransfer, measure_transfer
from selfopd.diagnostics.signals_report import (SignalDiagnosis, measure_signals, render_signals, signals_json,
                                                write_signal_outputs)
from selfopd.engines.base import Engine
from selfopd.data.example import Example
from selfopd.core.run_folder import RunFolder, load_run_config
from selfopd.run.verifier_isolation import use_verifier_isolation
from selfopd.core.stats import MeanEstimate

CLASS_NOTES = {
    "answer_copy": "states the reference answer, or copies a phrase of the privileged text",
    "answer_slot": "the student's own final answer where it differs from the reference",
    "epistemic": "doubt and checking words (wait, maybe, check, ...)",
    "structural": "whitespace, punctuation, operators, markup, special tokens",
    "other": "the rest: words and numbers of the reasoning",
}


@dataclass(frozen=True)
class TemplateDiagnosis:
    """A teacher template judged on given rollouts with one model: privileged gain by
    token class, the illusion score, the wrong-context contrast and (optionally) the gap."""

    template: str
    rollouts: list[Annotated]  # advantage = privileged gain with the correct context
    gains_wrong: list[np.ndarray]
    decomposition: list[ClassRow]
    illusion: IllusionScore
    contrast: ContextContrast
    gap: ContextGap | None


def diagnose_template(
    engine: Engine,
    records: Sequence[RolloutRecord],
    prompting: Prompting,
    gap_examples: Sequence[Example] = (),
    gap_max_tokens: int = 64,
    student_engine: Engine | None = None,
    batch_size: int = 16,
    progress: bool = False,
) -> TemplateDiagnosis:
    """`engine` serves the teacher's weights, whose privileged gain is measured (the
    student's own for a `self` teacher); `student_engine` (default: the same) is the
    gap's no-context baseline."""
    gains, wrong = privileged_gains(engine, records, prompting, batch_size, progress)
    annotated = [dataclasses.replace(a, advantage=g) for a, g in zip(annotate_records(records, prompting), gains)]
    gap = None
    if gap_examples:
        gap = context_gap(student_engine or engine, engine, gap_examples, prompting, gap_max_tokens, batch_size,
                          progress)
    return TemplateDiagnosis(prompting.teacher_template.name, annotated, wrong, decompose(annotated),
                             illusion_score(annotated), context_contrast(annotated, gains, wrong), gap)


@dataclass(frozen=True)
class RunDiagnosis:
    """Everything `selfopd diagnose` reports about one run."""

    name: str
    teacher: str  # "self with teacher/answer_note"
    student_template: str
    annotated: dict[int, list[Annotated]]  # saved rollouts by step, advantage = teacher - student
    behaviour: list[StepBehaviour]
    illusion: dict[int, IllusionScore]
    decompositions: dict[str, list[ClassRow]]  # first and last saved step
    warnings: list[str]
    outcome: str  # base vs trained held-out accuracy, from the run's evaluations
    preference: MeanEstimate | None  # teacher signal on correct - wrong samples of a prompt, all saved steps
    model_part: TemplateDiagnosis | None  # with the starting weights
    signals: SignalDiagnosis | None = None  # teachability, contrastive gain, DOPD split; starting weights
    transfer: MeasuredTransfer | None = None  # the gap closed on held-out vs trained prompts; start and final weights

    @property
    def first(self) -> int:
        return min(self.annotated)

    @property
    def last(self) -> int:
        return max(self.annotated)

    @functools.cached_property
    def episodes(self) -> dict[int, EpisodeStats]:
        """Per-turn statistics of the first and last saved step of a run whose rollouts are episodes; else {}."""
        return run_episodes(self.annotated)


def measure_run(run_dir: Path, with_model: bool = True, gap_items: int = 100, progress: bool = True,
                transfer_items: int = 64, teacher: str = "default", overrides: Sequence[str] = ()) -> RunDiagnosis:
    """Everything the report shows, from RUN_DIR's config (with `overrides`), rollouts and evals; `with_model` adds the
    wrong-context contrast, the gap and, with a checkpoint, the transfer on `transfer_items` trained and held-out prompts."""
    from selfopd.data import load_examples
    from selfopd.data.split import split_examples
    from selfopd.run.summary import summarize_run

    if not RunFolder(run_dir).is_run():
        raise FileNotFoundError(f"{run_dir}: not a run folder (no config.toml)")
    if (config := load_run_config(run_dir, overrides)).teacher.kind == "none":
        raise DiagnosticsError(f"{run_dir}: teacher.kind = 'none' (GRPO alone): no teacher signal to diagnose")
    use_verifier_isolation(config.verifier.isolation)
    by_step = read_run_rollouts(run_dir)
    examples = load_examples(config.data.spec)
    train_examples, eval_examples = split_examples(examples, eval_size=config.data.eval_size, seed=config.data.split_seed)
    if config.teachers or teacher != "default":
        by_step, train_examples, eval_examples = one_teachers_part(run_dir, config, teacher, by_step, train_examples, eval_examples)
    table, prompting = teacher_tables(config)[teacher], run_prompting(run_dir, config, examples, teacher)

    annotated = {step: annotate_records(records, prompting, progress) for step, records in by_step.items()}
    behaviour = [step_behaviour(step, rollouts, config.rollout.max_tokens) for step, rollouts in annotated.items()]
    first, last = min(annotated), max(annotated)
    decompositions = {f"step {step}": decompose(annotated[step]) for step in sorted({first, last})}
    model_part = signals = transfer_part = None
    if with_model:
        from selfopd.engines.build import engines_at_start

        student_engine, teacher_engine = engines_at_start(config, teacher)
        model_part = diagnose_template(teacher_engine, by_step[first], prompting, eval_examples[:gap_items],
                                       config.eval.max_tokens, student_engine, config.eval.batch_size, progress)
        signals = measure_signals(student_engine, teacher_engine, by_step[first], prompting, table.kind,
                                  config.rollout.temperature, config.eval.batch_size)
        checkpoint = RunFolder(run_dir).latest_checkpoint()
        if transfer_items and checkpoint is not None:
            transfer_part = measure_transfer(config, checkpoint, prompting, teacher_engine, student_engine,
                                             train_examples, eval_examples, transfer_items)
    suffix = "" if teacher == "default" else f" (teacher {teacher!r})"
    return RunDiagnosis(
        run_dir.name, f"{table.kind} with {prompting.teacher_template.name}{suffix}", prompting.student_template.name,
        annotated, behaviour, {step: illusion_score(rollouts) for step, rollouts in annotated.items()},
        decompositions, collapse_warnings(behaviour, _read_metrics(run_dir)), summarize_run(run_dir),
        correct_preference([record for records in by_step.values() for record in records]), model_part, signals,
        transfer_part)


def write_report(diagnosis: RunDiagnosis, out: Path, heatmaps: int = 4) -> Path:
    """Write out/{report.md, summary.json, figures/, heatmaps.html}; returns report.md."""
    out.mkdir(parents=True, exist_ok=True)
    figures = _write_figures(diagnosis, out, heatmaps)
    summary = {
        "run": diagnosis.name, "teacher": diagnosis.teacher, "student_template": diagnosis.student_template,
        "steps": sorted(diagnosis.annotated), "outcome": diagnosis.outcome,
        "illusion": {step: _illusion_json(score) for step, score in diagnosis.illusion.items()},
        "decomposition": as_jsonable(diagnosis.decompositions), "behaviour": as_jsonable(diagnosis.behaviour),
        "warnings": diagnosis.warnings, "teacher_prefers_correct": as_jsonable(diagnosis.preference),
    }
    part = diagnosis.model_part
    if part is not None:
        summary["at_start"] = {"privileged_gain_decomposition": as_jsonable(part.decomposition),
                               "illusion": _illusion_json(part.illusion), "contrast": as_jsonable(part.contrast),
                               "gap": as_jsonable(part.gap)}
    if episodes := diagnosis.episodes:
        summary["episodes"] = {step: episodes_json(stats) for step, stats in episodes.items()}
    if diagnosis.transfer is not None:
        summary["transfer"] = diagnosis.transfer.save(out)
    if diagnosis.signals is not None:
        summary["signals"] = signals_json(diagnosis.signals)
        figures |= write_signal_outputs(diagnosis.signals, out)
    write_json_atomic(out / "summary.json", summary)
    return write_text_atomic(out / "report.md", render_report(diagnosis, figures))


def _read_metrics(run_dir: Path) -> list[dict]:
    from selfopd.core.plots import read_metrics

    path = RunFolder(run_dir).metrics
    return read_metrics(path) if path.is_file() else []


def _illusion_json(score: IllusionScore) -> dict[str, Any]:
    return {**as_jsonable(score), "lift": as_jsonable(score.lift), "warning": score.warning}


def _write_figures(diagnosis: RunDiagnosis, out: Path, heatmaps: int) -> dict[str, str]:
    """Figures under out/figures and heatmaps.html; returns {key: path relative to out}."""
    from selfopd.diagnostics.figures import plot_behaviour, plot_class_shares

    folder = out / "figures"
    folder.mkdir(exist_ok=True)
    plot_class_shares(diagnosis.decompositions, folder / "classes.png", diagnosis.name)
    plot_behaviour(diagnosis.behaviour, diagnosis.illusion, folder / "behaviour.png", diagnosis.name)
    figures = {"classes": "figures/classes.png", "behaviour": "figures/behaviour.png"}
    steps = sorted({diagnosis.first, diagnosis.last})
    figures |= write_step_heatmaps(diagnosis.annotated, steps, folder, heatmaps)
    if (part := diagnosis.model_part) is not None:
        write_contrast_heatmap(part.rollouts, part.gains_wrong, folder / "contrast.png")
        figures["contrast"] = "figures/contrast.png"
    write_heatmaps_html(diagnosis.annotated, steps, max(heatmaps, 8), out / "heatmaps.html",
                        f"{diagnosis.name}: per-token advantage")
    return figures


def render_report(diagnosis: RunDiagnosis, figures: dict[str, str]) -> str:
    d, first, last = diagnosis, diagnosis.first, diagnosis.last
    lines = [
        f"# Privileged-illusion diagnostics: {d.name}",
        "",
        f"Teacher: `{d.teacher}`; student template `{d.student_template}`. "
        f"{sum(len(v) for v in d.annotated.values())} saved rollouts over {len(d.annotated)} step(s) "
        f"({first} to {last}). Intervals are 95% bootstrap intervals over the distinct prompts "
        f"({len({r.record.prompt for rs in d.annotated.values() for r in rs})}) the rollouts answer.",
        "",
        "## Verdict",
        "",
    ]
    for step in sorted({first, last}):
        score = d.illusion[step]
        flag = "**WARNING**" if score.warning else "no warning"
        lines.append(f"- Illusion score at step {step}: **{score.share}** over {score.share.n} distinct prompts; "
                     f"answer tokens are {score.token_share:.1%} of tokens, so their share of |advantage| is "
                     f"**{score.lift:.1f}x** their share of tokens ({flag}: it warns at {score.lift_threshold}x "
                     "with the interval above their share).")
    per_step = min(len(v) for v in d.annotated.values())
    if per_step < 32:
        lines.append(f"- Only {per_step} rollouts saved per step: intervals are wide. Raise `run.rollouts_to_save` "
                     "(default 32) for a sharper picture.")
    lines.append(_preference_line(d.preference))
    if d.model_part is not None:
        lines.append(f"- Before training, privileged gain (same weights, with minus without context): illusion score "
                     f"**{d.model_part.illusion.share}**.")
    if d.transfer is not None:
        lines.append(d.transfer.line())
    lines += [f"- {w}" for w in d.warnings] or ["- No collapse of length or epistemic words, no leaked phrases in outputs."]
    lines += [
        "",
        "Held-out outcome of the run (greedy, paired over the same items):",
        "",
        "```",
        d.outcome,
        "```",
        "",
        "The illusion score is the share of the teacher's total |advantage| on answer tokens (classes "
        "`answer_copy` and `answer_slot`). A teacher that read the answer off its context and teaches only that "
        "puts its signal there: the student is pushed to state an answer it was never shown. On tasks the student "
        "can compute, a high score is a warning to check the wrong-context contrast and held-out accuracy, not a verdict.",
        "",
        "## Where the advantage sits",
        "",
        f"![class shares]({figures['classes']})",
        "",
        _class_table(d.decompositions),
        "",
        "## Over training",
        "",
        f"![behaviour]({figures['behaviour']})",
        "",
        "| step | rollouts | accuracy | length (tokens) | at the cap | epistemic / 100 tok | leaking outputs | illusion score |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in d.behaviour:
        lines.append(f"| {b.step} | {b.rollouts} | {b.accuracy:.2f} | {b.length.value:.1f} [{b.length.low:.1f}, "
                     f"{b.length.high:.1f}] | {b.at_cap:.0%} | {b.epistemic_per_100:.2f} | {b.leak_rate:.0%} | "
                     f"{d.illusion[b.step].share} |")
    if d.episodes:
        lines += ["", render_episodes(d.episodes)]
    if d.model_part is not None:
        lines += ["", _model_section(d.model_part, first, figures)]
    if d.signals is not None:
        lines += ["", render_signals(d.signals, figures)]
    leaks = [(step, r) for step, rollouts in d.annotated.items() for r in rollouts if r.leaks]
    if leaks:
        lines += ["", "## Outputs that refer to or copy privileged context", ""]
        for step, r in leaks[:8]:
            lines.append(f"- step {step}, item {r.record.id}: {', '.join(repr(p) for p in r.leaks[:3])}")
    lines += ["", "## Per-token heatmaps", "",
              "Blue: the teacher likes the token more than the student does; red: less. "
              "Interactive view with logprobs on hover: [heatmaps.html](heatmaps.html).", ""]
    lines += [f"![{key}]({path})" for key, path in figures.items() if key.startswith("heatmap")]
    lines += ["", "## Token classes", ""] + [f"- `{k}`: {v}" for k, v in CLASS_NOTES.items()]
    return "\n".join(lines) + "\n"


def _preference_line(p: MeanEstimate | None) -> str:
    """Whether the teacher's signal ranks the student's correct attempts above its wrong ones."""
    if p is None:
        return ("- Teacher prefers correct attempts: not measurable (no saved prompt group has both a correct "
                "and a wrong sample).")
    verdict = ("it favours correct attempts" if p.low > 0 else
               "**it favours the wrong attempts: this teacher pushes the student toward wrong answers**" if p.high < 0
               else "**not reliably positive: the signal does not rank correct attempts above wrong ones**")
    return (f"- Teacher prefers correct attempts (mean teacher - student logprob per token, correct minus wrong "
            f"samples of the same prompt, {p.n} prompts): {p.value:+.3f} [{p.low:+.3f}, {p.high:+.3f}]; {verdict}.")


def _class_table(decompositions: dict[str, list[ClassRow]]) -> str:
    labels = list(decompositions)
    header = "| class | " + " | ".join(f"{label}: tokens | {label}: share of \\|adv\\| | {label}: mean adv"
                                      for label in labels) + " |"
    rows = [header, "|---|" + "---:|---:|---:|" * len(labels)]
    for index, name in enumerate(row.name for row in decompositions[labels[0]]):
        cells = []
        for label in labels:
            row = decompositions[label][index]
            cells.append(f"{row.token_share:.1%} | {row.abs_share} | {_signed(row.mean)}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _model_section(part: TemplateDiagnosis, step: int, figures: dict[str, str]) -> str:
    contrast = part.contrast
    lines = [
        f"## Wrong-context contrast (rollouts of step {step}, starting weights)",
        "",
        "The same rollouts scored with the correct privileged context and with a deliberately wrong one "
        "(a nearby wrong number or another item's answer; another item's hints and solution). Privileged gain "
        "= log p(token | context) - log p(token | no context), same weights.",
        "",
        "| class | mean gain, correct context | mean gain, wrong context |",
        "|---|---:|---:|",
    ]
    for name in contrast.mean_gain_correct:
        lines.append(f"| {name} | {_signed(contrast.mean_gain_correct[name])} | {_signed(contrast.mean_gain_wrong[name])} |")
    lines += [
        "",
        f"- Share of the correct-vs-wrong difference (sum of |gain - gain_wrong|) on answer tokens: "
        f"**{contrast.answer_share_of_difference}**.",
        "- Correct rollouts whose answer tokens gain more with the correct context than with the wrong one: "
        + (f"**{_percent(contrast.follows_context)}** of {contrast.correct_rollouts}: near 100% means the teacher "
           "reads the answer off its context." if contrast.correct_rollouts else "none of these rollouts is correct."),
    ]
    if "contrast" in figures:
        lines += ["", f"![contrast]({figures['contrast']})"]
    if part.gap is not None:
        gap = part.gap
        lines += [
            "",
            "## Gap before training (greedy, held-out items, starting weights)",
            "",
            "| | accuracy [95% CI] |",
            "|---|---:|",
            f"| student (no context) | {gap.student} |",
            f"| teacher weights alone (no context) | {gap.teacher_alone} |",
            f"| teacher with the privileged context | {gap.with_context} |",
            "",
            f"Gap (teacher with context - student): **{gap.gap}**. It bounds what the context can teach; when it "
            "comes from a stated answer, most of it is the illusion's, not an attainable target.",
        ]
    return "\n".join(lines)


def _signed(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:+.3f}"


def _percent(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.0%}"
