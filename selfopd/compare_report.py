"""The report of a comparison: one table row per arm, and accuracy against three budgets.

Everything is read back from the arms' run folders (metrics.jsonl, eval/step_*/eval.jsonl,
rollouts/step_*.jsonl), so a report can be rewritten at any time, also while later arms still run. Accuracy
changes are paired differences on the same held-out items: against the shared base
model, and against the comparison's reference arm.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

from selfopd.config import load_config
from selfopd.diagnostics.measures import correct_preference
from selfopd.diagnostics.records import read_run_rollouts
from selfopd.plots import STYLE, decorate, new_figure, read_metrics, save_figure
from selfopd.stats import MeanEstimate, PairedDifference, Proportion, paired_difference, wilson_interval

if TYPE_CHECKING:
    from selfopd.compare import CompareConfig


@dataclass(frozen=True)
class EvalPoint:
    """One held-out eval of an arm, placed on all three budget axes."""

    step: int
    accuracy: float
    low: float
    high: float
    generated_tokens: int  # student tokens sampled for training up to this step
    train_seconds: float  # wall time of the training steps up to this step (evals excluded)


@dataclass(frozen=True)
class ArmResult:
    name: str
    description: str
    teacher: str
    loss: str
    steps: int
    finished: bool
    final: Proportion
    vs_base: PairedDifference
    vs_reference: PairedDifference | None
    generated_tokens: int
    train_seconds: float
    kl_first: float
    kl_last: float
    opd_weight: float  # loss.lambda_opd: 0 when the teacher only fills the KL column
    teacher_preference: MeanEstimate | None  # signal on correct - wrong samples of a prompt (saved rollouts)
    curve: list[EvalPoint]


def measure_arm(run_dir: Path, name: str, description: str = "") -> ArmResult | None:
    """What an arm's run folder shows; None when it has no eval after step 0 yet."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    config = load_config(run_dir / "config.toml")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = [m for m in metrics if "time/step" in m]
    curve, tokens, seconds = [], 0, 0.0
    for m in metrics:  # in log order: a step's row comes before that step's eval
        if "time/step" in m:
            tokens, seconds = tokens + int(m["tokens/completion"]), seconds + m["time/step"]
        if "eval/accuracy" in m:
            curve.append(EvalPoint(m["step"], m["eval/accuracy"], m["eval/ci_low"], m["eval/ci_high"], tokens, seconds))
    if len(curve) < 2:
        return None
    base, last = eval_outcomes(run_dir, curve[0].step), eval_outcomes(run_dir, curve[-1].step)
    ids = sorted(base)
    teacher = config.teacher.kind + (f" {config.teacher.model}" if config.teacher.model else "") + f", {config.teacher.template}"
    if config.loss.lambda_opd == 0:
        teacher = f"none (KL column: {teacher})"
    loss = f"{config.loss.lambda_opd:g} x OPD + {config.loss.lambda_rl:g} x GRPO"
    return ArmResult(
        name=name, description=description, teacher=teacher, loss=loss, steps=curve[-1].step,
        finished=curve[-1].step == config.run.steps,
        final=wilson_interval(sum(last[i] for i in ids), len(ids)),
        vs_base=paired_difference([base[i] for i in ids], [last[i] for i in ids]), vs_reference=None,
        generated_tokens=tokens, train_seconds=seconds,
        kl_first=steps[0]["opd/reverse_kl"] if steps else math.nan,
        kl_last=steps[-1]["opd/reverse_kl"] if steps else math.nan,
        opd_weight=config.loss.lambda_opd,
        teacher_preference=_teacher_preference(run_dir),
        curve=curve,
    )


def _teacher_preference(run_dir: Path) -> MeanEstimate | None:
    """`correct_preference` over every saved rollout; None for a run that saved none."""
    try:
        by_step = read_run_rollouts(run_dir)
    except FileNotFoundError:  # run.rollouts_to_save = 0
        return None
    return correct_preference([record for records in by_step.values() for record in records])


def eval_outcomes(run_dir: Path, step: int) -> dict[str, bool]:
    """Held-out id -> correct, for one eval of a run."""
    path = run_dir / "eval" / f"step_{step:05d}" / "eval.jsonl"
    return {record["id"]: record["correct"] for record in map(json.loads, path.read_text().splitlines())}


def measure_comparison(compare: CompareConfig) -> list[ArmResult]:
    """Every arm with results, in the file's order, with paired differences vs the reference arm."""
    results = {arm.name: measure_arm(compare.arm_dir(arm.name), arm.name, arm.description) for arm in compare.arms}
    found = {name: result for name, result in results.items() if result is not None}
    reference = found.get(compare.reference)
    if reference is None:
        return list(found.values())
    reference_outcomes = eval_outcomes(compare.arm_dir(reference.name), reference.steps)
    measured = []
    for name, result in found.items():
        if name != reference.name:
            outcomes = eval_outcomes(compare.arm_dir(name), result.steps)
            ids = sorted(outcomes)
            difference = paired_difference([reference_outcomes[i] for i in ids], [outcomes[i] for i in ids])
            result = replace(result, vs_reference=difference)
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
    """The comparison as markdown: settings, table, verdicts, figure, caveats."""
    lines = [f"# Comparison `{compare.name}`", ""]
    lines += [f"Base config `{compare.base.name}`; shared settings: "
              + (", ".join(f"`{o}`" for o in compare.common) or "none") + ".", ""]
    if not results:
        return "\n".join(lines + ["No arm has finished an evaluation yet.", ""])
    base = results[0].curve[0]
    n = results[0].final.n
    lines += [f"Base model (step 0, shared by all arms): held-out accuracy {base.accuracy:.3f} "
              f"[{base.low:.3f}, {base.high:.3f}] (n={n}, greedy).", ""]
    reference = f"vs `{compare.reference}`" if compare.reference else ""
    header = ["arm", "teacher", "loss", "steps", "held-out acc. [95% CI]", "change vs base [95% CI]"]
    if reference:
        header.append(f"change {reference} [95% CI]")
    header += ["generated tokens", "train time (min)", "reverse KL first -> last",
               "teacher prefers correct [95% CI] (prompts)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        steps = f"{r.steps}" + ("" if r.finished else " (unfinished)")
        row = [f"`{r.name}`", r.teacher, r.loss, steps, f"{r.final.value:.3f} [{r.final.low:.3f}, {r.final.high:.3f}]",
               _difference(r.vs_base)]
        if reference:
            row.append("(reference)" if r.name == compare.reference else _difference(r.vs_reference))
        row += [f"{r.generated_tokens:,}", f"{r.train_seconds / 60:.1f}", f"{r.kl_first:.3f} -> {r.kl_last:.3f}",
                _preference(r.teacher_preference)]
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
              "- Intervals are over held-out items (paired: the same items for every arm and the base). "
              "They do not cover training-seed variance: one seed per arm.",
              "- The reverse KL is each arm's sampled estimate against its own teacher, so it is not comparable "
              "across teachers, and a falling KL is not a gain: check the accuracy column.",
              "- Teacher prefers correct: per saved rollout the mean teacher - student logprob per token; within "
              "each prompt whose samples were both right and wrong, correct minus wrong; the mean over those prompts. "
              "Positive: the distillation signal favours the student's correct attempts. Not positive: it pushes "
              "toward wrong answers as hard as toward right ones, whatever the KL does. (For an arm without the "
              "OPD term it describes the teacher scored for the KL column, not what trained.)",
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
    from selfopd.sft import SftConfig

    folder = Path(compare.sft.get("out_dir", compare.folder)) / compare.sft.get("name", SftConfig().name)
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
    if d.low > 0:
        return "**better**"
    if d.high < 0:
        return "**worse**"
    return "no significant difference"


def write_compare_report(compare: CompareConfig) -> Path:
    """Write report.md, accuracy.png and summary.json under the comparison's folder."""
    results = measure_comparison(compare)
    figure = plot_comparison(results, compare.folder / "accuracy.png", compare.name) if results else None
    summary = [{**asdict(r), "final_accuracy": r.final.value} for r in results]
    (compare.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = compare.folder / "report.md"
    report.write_text(render_report(compare, results, figure))
    return report
