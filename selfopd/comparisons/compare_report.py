"""The report of a comparison: one table row per arm, pooled over its training seeds, one
row per (arm, seed), and accuracy against three budgets.

Everything is read back from the runs' folders (metrics.jsonl, eval/step_*/eval.jsonl,
rollouts/step_*.jsonl or a restored run's rollouts/digest.jsonl), so a report can be rewritten at any time, also while later runs
still train. Accuracy changes are paired by prompt, each distinct prompt counted once:
against the shared base model, and against the comparison's reference arm under the same
seed. Pooled over seeds, intervals treat prompts and seeds as random draws
(`selfopd.core.stats.pooled_change`); a difference is called only when its interval excludes 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np

from selfopd.core.atomic import write_json_atomic, write_text_atomic
from selfopd.core.run_folder import RunFolder
from selfopd.config import load_config
from selfopd.diagnostics.measures import correct_preference
from selfopd.run.rollouts import RolloutDigest, RolloutRecord, read_rollout_digest, read_run_rollouts
from selfopd.run.evaluate import read_eval_outcomes
from selfopd.core.plots import STYLE, decorate, new_figure, read_metrics, save_figure
from selfopd.core.stats import MeanEstimate, PairedDifference, Proportion, paired_change, pooled_accuracy, pooled_change

if TYPE_CHECKING:
    from selfopd.comparisons.compare import CompareConfig


@dataclass(frozen=True)
class EvalPoint:
    """One held-out eval of a run, placed on all three budget axes."""

    step: int
    accuracy: float
    low: float
    high: float
    generated_tokens: int  # student tokens sampled for training up to this step
    train_seconds: float  # wall time of the training steps up to this step (evals excluded)


@dataclass(frozen=True)
class SeedRun:
    """What one (arm, seed) run folder shows."""

    seed: int
    steps: int
    finished: bool
    base: dict[str, list[bool]]  # prompt key -> outcomes at the first eval
    final: dict[str, list[bool]]  # ... at the last eval
    vs_base: PairedDifference
    generated_tokens: int
    train_seconds: float
    kl_first: float
    kl_last: float
    curve: list[EvalPoint]
    guard_stopped: bool = False  # the illusion guard stopped it (finished.json says at which step)

    @property
    def final_accuracy(self) -> float:
        """Accuracy at the last eval, each distinct prompt counted once."""
        return float(np.mean([np.mean(outcomes) for outcomes in self.final.values()]))


@dataclass(frozen=True)
class ArmResult:
    """An arm over its seeds: pooled numbers, and each seed's."""

    name: str
    description: str
    teacher: str
    loss: str
    steps: int
    finished: bool
    final: Proportion | MeanEstimate  # accuracy at the last eval, pooled over seeds
    vs_base: PairedDifference  # pooled over seeds
    vs_reference: PairedDifference | None  # pooled over seeds, paired with the reference arm's run of each seed
    per_seed: list[SeedRun]
    per_seed_vs_reference: dict[int, PairedDifference]
    generated_tokens: float  # mean over seeds
    train_seconds: float  # mean over seeds
    kl_first: float  # mean over seeds
    kl_last: float
    opd_weight: float  # loss.lambda_opd: 0 when the teacher only fills the KL column
    teacher_preference: MeanEstimate | None  # signal on correct - wrong samples of a prompt (saved rollouts)

    @property
    def seeds(self) -> list[int]:
        return [run.seed for run in self.per_seed]

    @property
    def curve(self) -> list[EvalPoint]:
        """Mean accuracy and budgets per eval step over the seeds that reached it."""
        by_step: dict[int, list[EvalPoint]] = {}
        for run in self.per_seed:
            for point in run.curve:
                by_step.setdefault(point.step, []).append(point)
        return [EvalPoint(step, *(float(np.mean([getattr(p, f) for p in points]))
                                  for f in ("accuracy", "low", "high", "generated_tokens", "train_seconds")))
                for step, points in sorted(by_step.items())]


def measure_seed_run(run_dir: Path, seed: int) -> SeedRun | None:
    """What a run folder shows; None when it has no eval after step 0 yet."""
    if not RunFolder(run_dir).metrics.is_file():
        return None
    config = load_config(RunFolder(run_dir).config)
    metrics = read_metrics(RunFolder(run_dir).metrics)
    steps = [m for m in metrics if "time/step" in m]
    curve, tokens, seconds = [], 0, 0.0
    for m in metrics:  # in log order: a step's row comes before that step's eval
        if "time/step" in m:
            tokens, seconds = tokens + int(m["tokens/completion"]), seconds + m["time/step"]
        if "eval/accuracy" in m:
            curve.append(EvalPoint(m["step"], m["eval/accuracy"], m["eval/ci_low"], m["eval/ci_high"], tokens, seconds))
    if len(curve) < 2:
        return None
    base, final = eval_outcomes(run_dir, curve[0].step), eval_outcomes(run_dir, curve[-1].step)
    return SeedRun(
        seed=seed, steps=curve[-1].step, finished=curve[-1].step == config.run.steps, base=base, final=final,
        vs_base=paired_change(base, final), generated_tokens=tokens, train_seconds=seconds,
        kl_first=steps[0].get("opd/reverse_kl", math.nan) if steps else math.nan,  # nan: no teacher
        kl_last=steps[-1].get("opd/reverse_kl", math.nan) if steps else math.nan, curve=curve,
        guard_stopped=_guard_stopped(RunFolder(run_dir)),
    )


def _guard_stopped(folder: RunFolder) -> bool:
    return folder.finished.is_file() and "stopped_by_guard" in json.loads(folder.finished.read_text())


def measure_arm(compare: CompareConfig, name: str, description: str = "") -> ArmResult | None:
    """An arm pooled over the seeds that have results; None when none has."""
    runs = [run for run in (measure_seed_run(compare.arm_dir(name, seed), seed) for seed in compare.seeds) if run]
    if not runs:
        return None
    config = load_config(RunFolder(compare.arm_dir(name, runs[0].seed)).config)
    teacher = config.teacher.kind + (f" {config.teacher.model}" if config.teacher.model else "") + f", {config.teacher.template}"
    if config.loss.lambda_opd == 0:
        teacher = f"none (KL column: {teacher})"
    return ArmResult(
        name=name, description=description, teacher=teacher,
        loss=loss_label(config.loss),
        steps=min(run.steps for run in runs), finished=all(run.finished for run in runs),
        final=pooled_accuracy([run.final for run in runs]),
        vs_base=pooled_change([(run.base, run.final) for run in runs]), vs_reference=None,
        per_seed=runs, per_seed_vs_reference={},
        generated_tokens=float(np.mean([run.generated_tokens for run in runs])),
        train_seconds=float(np.mean([run.train_seconds for run in runs])),
        kl_first=float(np.mean([run.kl_first for run in runs])), kl_last=float(np.mean([run.kl_last for run in runs])),
        opd_weight=config.loss.lambda_opd,
        teacher_preference=_teacher_preference([compare.arm_dir(name, run.seed) for run in runs]),
    )


def loss_label(loss: Any) -> str:
    """The loss in a few words: its weights, and each cure (`selfopd.training.advantages`) that is on."""
    cures = [f"RLSD l={loss.rlsd_weight:g}/{loss.rlsd_decay_steps} steps" if loss.rlsd_weight else "",
             "OPD on failed only" if loss.opd_on == "failed" else "",
             "vs wrong context" if loss.opd_baseline == "wrong_context" else "",
             "pass-rate weighted" if loss.pass_rate_weighting else "",
             f"clip {loss.token_clip:g}" + (" per vocabulary entry" if loss.clip_per == "vocabulary_entry" else "")
             if loss.token_clip else "",
             {"group_mean": "GRPO r - mean", "raw": "GRPO raw reward"}.get(loss.rl_advantage, ""),
             f"wrong reward {loss.wrong_reward:g}" if loss.wrong_reward else ""]
    extra = ", ".join(cure for cure in cures if cure)
    return f"{loss.lambda_opd:g} x OPD + {loss.lambda_rl:g} x GRPO" + (f" ({extra})" if extra else "")


def _teacher_preference(run_dirs: list[Path]) -> MeanEstimate | None:
    """`correct_preference` over every saved rollout of the runs (or their digest, for a run
    restored from an archive of records); None for runs that saved none."""
    records: list[RolloutRecord | RolloutDigest] = []
    for run_dir in run_dirs:
        try:
            by_step = read_run_rollouts(run_dir)
        except FileNotFoundError:  # run.rollouts_to_save = 0, or only the digest kept
            records += read_rollout_digest(run_dir)
            continue
        records += [record for step_records in by_step.values() for record in step_records]
    return correct_preference(records) if records else None


def eval_outcomes(run_dir: Path, step: int) -> dict[str, list[bool]]:
    """Prompt key -> outcomes, for one eval of a run."""
    return read_eval_outcomes(RunFolder(run_dir).eval_dir(step))


def measure_comparison(compare: CompareConfig) -> list[ArmResult]:
    """Every arm with results, in the file's order, with paired differences vs the reference
    arm: under each seed, against the reference arm's run of that seed; then pooled."""
    results = {arm.name: measure_arm(compare, arm.name, arm.description) for arm in compare.arms}
    found = {name: result for name, result in results.items() if result is not None}
    reference = found.get(compare.reference)
    if reference is None:
        return list(found.values())
    reference_final = {run.seed: run.final for run in reference.per_seed}
    measured = []
    for name, result in found.items():
        if name != reference.name:
            pairs = {run.seed: (reference_final[run.seed], run.final) for run in result.per_seed
                     if run.seed in reference_final}
            if pairs:
                result = replace(result, per_seed_vs_reference={seed: paired_change(*pair) for seed, pair in pairs.items()},
                                 vs_reference=pooled_change(list(pairs.values())))
        measured.append(result)
    return measured


def plot_comparison(results: list[ArmResult], path: Path, title: str = "") -> Path:
    """Held-out accuracy against steps, generated tokens and training wall time, and each
    arm's paired change over the base model with its 95% interval.

    The absolute intervals of arms that start from one model overlap almost entirely (they
    share the items' difficulty); the paired change is where arms actually separate, so it
    gets its own panel instead of wide bands."""
    axes_spec = (("step", "step", lambda p: p.step),
                 ("generated tokens (student samples)", "tokens", lambda p: p.generated_tokens),
                 ("training wall time (minutes)", "minutes", lambda p: p.train_seconds / 60))
    with matplotlib.rc_context(STYLE):
        figure = new_figure(4, title)
        for axes, (label, short, x_of) in zip(figure.axes, axes_spec):
            for index, result in enumerate(results):
                xs = [x_of(p) for p in result.curve]
                ys = [p.accuracy for p in result.curve]
                axes.plot(xs, ys, color=f"C{index % 10}", marker="o", markersize=4, linewidth=1.6, label=result.name)
            decorate(axes, f"Accuracy vs {short}", "held-out accuracy (greedy)", xlabel=label)
        figure.axes[0].legend(loc="best", fontsize=8)
        _draw_changes(figure.axes[3], results)
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_figure(figure, path)


def _draw_changes(axes, results: list[ArmResult]) -> None:
    """One row per arm: paired change vs base at its last eval, 95% interval, zero marked."""
    rows = list(range(len(results)))[::-1]  # first arm on top, as in the legend
    for row, (index, result) in zip(rows, enumerate(results)):
        change = result.vs_base
        axes.errorbar([change.mean], [row], xerr=[[change.mean - change.low], [change.high - change.mean]],
                      color=f"C{index % 10}", marker="o", capsize=4, linewidth=1.6)
    axes.axvline(0.0, color="0.4", linewidth=1, linestyle="--")
    axes.set_yticks(rows, [result.name for result in results])
    decorate(axes, "Change vs base at the last eval", "", xlabel="paired change in held-out accuracy (95% CI)")


def render_report(compare: CompareConfig, results: list[ArmResult], figure: Path | None) -> str:
    """The comparison as markdown: settings, pooled table, per-seed table, verdicts, figure, caveats."""
    lines = [f"# Comparison `{compare.name}`", ""]
    lines += [f"Base config `{compare.base.name}`; shared settings: "
              + (", ".join(f"`{o}`" for o in compare.common) or "none")
              + f"; training seeds {', '.join(map(str, compare.seeds))}.", ""]
    if not results:
        return "\n".join(lines + ["No arm has finished an evaluation yet.", ""])
    base = results[0].curve[0]
    n = results[0].final.n
    lines += [f"Base model (step 0, shared by all arms and seeds): held-out accuracy {base.accuracy:.3f} "
              f"[{base.low:.3f}, {base.high:.3f}] over {n} distinct held-out prompts, none trained on (greedy).", ""]
    reference = f"vs `{compare.reference}`" if compare.reference else ""
    header = ["arm", "teacher", "loss", "steps", "seeds", "held-out acc. [95% CI]", "change vs base [95% CI]"]
    if reference:
        header.append(f"change {reference} [95% CI]")
    header += ["generated tokens", "train time (min)", "reverse KL first -> last",
               "teacher prefers correct [95% CI] (prompts)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        stopped = [str(run.seed) for run in r.per_seed if run.guard_stopped]
        steps = f"{r.steps}" + ("" if r.finished else f" (seed {', '.join(stopped)} stopped by the illusion guard)"
                                if stopped else " (unfinished)")
        row = [f"`{r.name}`", r.teacher, r.loss, steps, ", ".join(map(str, r.seeds)),
               f"{r.final.value:.3f} [{r.final.low:.3f}, {r.final.high:.3f}]", _difference(r.vs_base)]
        if reference:
            row.append("(reference)" if r.name == compare.reference else _difference(r.vs_reference))
        row += [f"{r.generated_tokens:,.0f}", f"{r.train_seconds / 60:.1f}", f"{r.kl_first:.3f} -> {r.kl_last:.3f}",
                _preference(r.teacher_preference)]
        lines.append("| " + " | ".join(row) + " |")
    if len(compare.seeds) > 1:
        lines += ["", "### Each seed", "", "| arm | seed | held-out acc. | change vs base [95% CI]"
                  + (f" | change {reference} [95% CI]" if reference else "") + " |",
                  "|---|---:|---:|---|" + ("---|" if reference else "")]
        for r in results:
            for run in r.per_seed:
                row = [f"`{r.name}`", str(run.seed), f"{run.final_accuracy:.3f}", _difference(run.vs_base)]
                if reference:
                    row.append("(reference)" if r.name == compare.reference
                               else _difference(r.per_seed_vs_reference.get(run.seed)))
                lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Verdicts", ""]
    for r in results:
        lines.append(f"- `{r.name}`: {_verdict(r.vs_base)} relative to the base model"
                     + (f"; {_verdict(r.vs_reference)} relative to `{compare.reference}`" if r.vs_reference else "")
                     + _preference_verdict(r) + ".")
    if figure is not None:
        lines += ["", f"![accuracy vs step, generated tokens and wall time]({figure.name})"]
    lines += _sft_lines(compare)
    lines += _timing_lines(compare.folder / "timing.jsonl")
    lines += ["", "## Reading this table", "",
              f"- The unit is the distinct prompt: {n} held-out prompts, each counted once, none of them trained on. "
              "Changes are paired by prompt (the same prompts for every arm, seed and the base)"
              + (f"; with {len(compare.seeds)} seeds, intervals treat prompts and seeds as random draws "
                 "(two-way random effects, t quantile at Satterthwaite's degrees of freedom), so a seed that "
                 "moves every prompt widens them." if len(compare.seeds) > 1 else
                 "; they do not cover training-seed variance: one seed per arm.")
              + " A difference is called only when its interval excludes 0.",
              "- The reverse KL is each arm's sampled estimate against its own teacher, so it is not comparable "
              "across teachers, and a falling KL is not a gain: check the accuracy column.",
              "- Teacher prefers correct: per saved rollout the mean teacher - student logprob per token; within "
              "each prompt group whose samples were both right and wrong, correct minus wrong; averaged per prompt, "
              "then over prompts (interval over prompts). Positive: the distillation signal favours the student's "
              "correct attempts. Not positive: it pushes toward wrong answers as hard as toward right ones, whatever "
              "the KL does. (For an arm without the OPD term it describes the teacher scored for the KL column, not "
              "what trained.)",
              "- Train time excludes evaluation; it is wall time on a shared machine, so compare it loosely.", ""]
    return "\n".join(lines)


def _preference(estimate: MeanEstimate | None) -> str:
    if estimate is None:
        return "n/a (no prompt with both outcomes)"
    return f"{estimate.value:+.3f} [{estimate.low:+.3f}, {estimate.high:+.3f}] ({estimate.n})"


def _sft_lines(compare: CompareConfig) -> list[str]:
    """How strong the [sft] teacher is on the arms' held-out items (its own before/after eval)."""
    if compare.sft is None:
        return []
    folder = compare.folder / compare.sft.name
    if not (folder / "summary.json").is_file():
        return []
    summary = json.loads((folder / "summary.json").read_text())
    tuned, diff = summary["tuned"], summary["paired_difference"]
    return ["", f"External teacher (`selfopd sft`, {summary['train_pairs']} {summary['targets']} targets, "
            f"{summary['steps']} steps): held-out accuracy {tuned['accuracy']:.3f} [{tuned['ci95'][0]:.3f}, "
            f"{tuned['ci95'][1]:.3f}], {diff['mean']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}] "
            f"over the base model (paired, n={summary['eval_n']}); see `{folder}/README.md`."]


def _timing_lines(path: Path) -> list[str]:
    """Wall time of what ran (the SFT teacher and each arm, evals included), from timing.jsonl."""
    if not path.is_file():
        return []
    seconds: dict[str, float] = {}
    for entry in map(json.loads, path.read_text().splitlines()):
        seconds[entry["what"]] = seconds.get(entry["what"], 0.0) + entry["wall_seconds"]
    parts = ", ".join(f"{what} {value / 60:.1f}" for what, value in seconds.items())
    return ["", f"Wall time, minutes (all sessions, evals included): {parts}; total {sum(seconds.values()) / 60:.1f}."]


def _difference(d: PairedDifference | None) -> str:
    return "" if d is None else f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def _preference_verdict(r: ArmResult) -> str:
    """Flag a trained-on teacher signal that does not favour correct attempts."""
    p = r.teacher_preference
    if p is None or r.opd_weight == 0 or p.low > 0:
        return ""
    interval = f"{p.value:+.3f} [{p.low:+.3f}, {p.high:+.3f}] over {p.n} prompts"
    if p.high < 0:
        return f"; its teacher signal favours the student's **wrong** attempts ({interval})"
    return f"; its teacher signal does not reliably favour correct attempts ({interval})"


def _verdict(d: PairedDifference | None) -> str:
    if d is None:
        return "not compared"
    return "no significant difference" if d.verdict == "no significant change" else f"**{d.verdict}**"


def write_compare_report(compare: CompareConfig) -> Path:
    """Write report.md, accuracy.png and summary.json under the comparison's folder."""
    results = measure_comparison(compare)
    figure = plot_comparison(results, compare.folder / "accuracy.png", compare.name) if results else None
    summary = [_summary_row(r) for r in results]
    write_json_atomic(compare.folder / "summary.json", summary)
    return write_text_atomic(compare.folder / "report.md", render_report(compare, results, figure))



def _summary_row(result: ArmResult) -> dict:
    """An arm as JSON: every field, each seed's final accuracy in place of its per-prompt
    outcome tables (those are in the runs' eval files)."""
    row = asdict(result)
    for run, seed_run in zip(row["per_seed"], result.per_seed):
        del run["base"], run["final"]
        run["final_accuracy"] = seed_run.final_accuracy
    return {**row, "final_accuracy": result.final.value}
