"""The cures comparison's report, from what `experiments/cures/run.py` left under its --out
(the finished runs it lacks are first restored from the study's archive of records):

    python -m experiments.cures.report                                 # -> runs/cures/report/
    python -m experiments.cures.report --out experiments/cures/results # the shipped copy

Writes cures_report.md, cures_summary.json and cures_accuracy_tokens.png. Verdicts follow
PREREGISTRATION.md's rule: a cure beats GRPO alone on a task when its pooled 95% interval
against `grpo_only` at the comparison's steps lies above 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import matplotlib

from experiments.cures.run import (CURES, ROOT, SHIPPED, STEPS, arm_complete, comparisons, grid_complete,
                                   longer_config, restore, shipped_complete, shipped_rows, task_specs)
from selfopd.comparisons.compare_report import ArmResult, measure_comparison
from selfopd.core.plots import STYLE, decorate, new_figure, save_figure
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import PairedDifference, pooled_change
from selfopd.run.evaluate import read_eval_outcomes

matplotlib.use("Agg")

REFERENCE = "grpo_only"


def verdict(d: PairedDifference | None) -> str:
    if d is None:
        return "not run"
    if d.low > 0:
        return "**beats GRPO alone**"
    if d.high < 0:
        return "**worse than GRPO alone**"
    return "no significant difference"


def _verdict_so_far(result: ArmResult, config) -> str:
    """The pre-registered verdict once every seed of the arm has finished; before, which seeds are in."""
    if result.name == REFERENCE:
        return ""
    if not arm_complete(result, config):
        return f"none yet (seed {', '.join(str(seed) for seed in result.seeds)} so far)"
    return verdict(result.vs_reference)


def interval(value: float, low: float, high: float) -> str:
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def fmt(d: PairedDifference | None) -> str:
    return "" if d is None else interval(d.mean, d.low, d.high)


def fresh_change(config, arm: str) -> PairedDifference | None:
    """The arm's final weights minus grpo_only's on the fresh prompts, paired per seed, pooled."""
    pairs = []
    for seed in config.seeds:
        ref, own = (config.arm_dir(name, seed) / "fresh_eval" for name in (REFERENCE, arm))
        if (ref / "summary.json").is_file() and (own / "summary.json").is_file():
            pairs.append((read_eval_outcomes(ref), read_eval_outcomes(own)))
    return pooled_change(pairs) if pairs else None


def fresh_prompts(config) -> int:
    summary = config.arm_dir(REFERENCE, config.seeds[0]) / "fresh_eval" / "summary.json"
    return json.loads(summary.read_text())["prompts"] if summary.is_file() else 0


def guard_fired(config, arm: str) -> list[str]:
    """'seed S: condition@step' for every guard event of the arm's runs."""
    fired = []
    for seed in config.seeds:
        path = RunFolder(config.arm_dir(arm, seed)).guard_events
        if path.is_file():
            fired += [f"seed {seed}: {e['condition']}@{e['step']}" for e in json.loads(path.read_text())]
    return fired


def diagnosis(config, arm: str) -> dict:
    """Seed 0's `selfopd diagnose` summary: the answer-token lift at the last step, its warning,
    the teacher-prefers-correct estimate, the DOPD information share (or why it is not defined)."""
    path = config.arm_dir(arm, config.seeds[0]) / "diagnostics" / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    last = summary["illusion"][str(max(int(step) for step in summary["illusion"]))]
    signals = summary.get("signals") or {}
    return {"lift": last.get("lift"), "warning": last.get("warning"),
            "teacher_prefers_correct": summary.get("teacher_prefers_correct"),
            "dopd_information_share": signals.get("dopd_information_share"), "dopd_note": signals.get("dopd_note")}


def task_section(task: str, config, results: list[ArmResult], fresh: dict, diagnoses: dict, guards: dict) -> list[str]:
    lines = [f"## Task: {task}", "", f"Data: `{_spec(config)}`; {len(config.seeds)} seeds; held-out prompts: "
             f"{results[0].final.n if results else 0} distinct, none trained on; fresh prompts: {fresh_prompts(config)} "
             "distinct, none in the run's data.", "",
             "| arm | loss | held-out acc. [95% CI] | change vs `grpo_only` [95% CI] | verdict | fresh prompts: change vs "
             "`grpo_only` | generated tokens | teacher prefers correct | guard fired |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        pref = r.teacher_preference
        lines.append(f"| `{r.name}` | {r.loss} | {r.final.value:.3f} [{r.final.low:.3f}, {r.final.high:.3f}] | "
                     f"{fmt(r.vs_reference) or '(reference)'} | {_verdict_so_far(r, config)} | "
                     f"{fmt(fresh.get(r.name)) or ('(reference)' if r.name == REFERENCE else '')} | "
                     f"{r.generated_tokens:,.0f} | {interval(pref.value, pref.low, pref.high) if pref else ''} | "
                     f"{len(guards[r.name])} event(s)" + " |")
    lines += ["", "Illusion measures on each arm's seed-0 run, last step (`selfopd diagnose`):", "",
              "| arm | answer-token lift | illusion warning | DOPD information share |", "|---|---|---|---|"]
    for r in results:
        d = diagnoses.get(r.name) or {}
        share = d.get("dopd_information_share")
        lines.append(f"| `{r.name}` | {d['lift']:.2f}x | {'yes' if d.get('warning') else 'no'} | "
                     f"{share if share is not None else 'not separable: ' + (d.get('dopd_note') or 'not run')} |"
                     if d else f"| `{r.name}` | not run | | |")
    return lines + [""]


def longer_section(longer, results: list[ArmResult]) -> list[str]:
    """The 3x-steps check: accuracy at every eval step, and the change vs grpo_only at the last
    step once every seed of both arms has finished (a run still going would be paired at
    another step)."""
    steps = sorted({p.step for r in results for p in r.curve if p.step > 0})
    complete = grid_complete(results, longer)
    lines = [f"## 3x the steps: `{longer.name}`", "",
             f"The cure with the largest point change at step {STEPS} and `grpo_only`, {3 * STEPS} steps, "
             f"seeds {', '.join(map(str, longer.seeds))}, on the task where that change was made; held-out accuracy "
             "pooled over the seeds that reached each step, on the same held-out prompts as the task's grid "
             "(same seeds and data order as the grid's runs).", "",
             "| arm | seeds finished | " + " | ".join(f"acc. at step {step}" for step in steps)
             + f" | change vs `{REFERENCE}` at step {3 * STEPS} [95% CI] | verdict at step {3 * STEPS} |",
             "|---|---|" + "---|" * len(steps) + "---|---|"]
    for r in results:
        at = {p.step: p.accuracy for p in r.curve}
        finished = [run.seed for run in r.per_seed if run.finished]
        change = fmt(r.vs_reference) if complete and r.vs_reference else ("(reference)" if r.name == REFERENCE else "waits for every seed")
        holds = "" if r.name == REFERENCE or not complete else verdict(r.vs_reference)
        lines.append(f"| `{r.name}` | {', '.join(map(str, finished)) or 'none'} | "
                     + " | ".join(f"{at[step]:.3f}" if step in at else "" for step in steps) + f" | {change} | {holds} |")
    return lines + [""]


def _spec(config) -> str:
    from selfopd.config import load_config

    run = config.arm_dir(REFERENCE, config.seeds[0])
    return load_config(RunFolder(run).config).data.spec if RunFolder(run).config.is_file() else "?"


def shipped_task_section(task: str, rows: list[dict]) -> list[str]:
    """A task known only by its shipped summary (run.SHIPPED): the primary metric, tokens and
    teacher preference; fresh prompts, guard events and diagnoses were never measured."""
    held_out = rows[0]["final"]["n"] if rows else 0
    lines = [f"## Task: {task}", "", f"From `{SHIPPED[task].relative_to(ROOT)}`, the summary of this grid's runs, "
             f"whose folders were not kept: held-out prompts: {held_out} distinct, none trained on. Its fresh-prompt "
             "evals, guard events and seed-0 diagnoses were never made (they need each run's folder or final weights).",
             "", "| arm | loss | held-out acc. [95% CI] | change vs `grpo_only` [95% CI] | verdict | fresh prompts: change vs "
             "`grpo_only` | generated tokens | teacher prefers correct | guard fired |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        change, final = row["vs_reference"], row["final"]
        d = PairedDifference(change["mean"], change["low"], change["high"], change["n"], change["seeds"]) if change else None
        lines.append(f"| `{row['name']}` | {row['loss']} | {final['value']:.3f} [{final['low']:.3f}, {final['high']:.3f}] | "
                     f"{fmt(d) or '(reference)'} | {verdict(d) if row['name'] != REFERENCE else ''} | not measured | "
                     f"{row['generated_tokens']:,.0f} | {_estimate(row['teacher_preference'])} | not kept |")
    return lines + [""]


def mean_curve(per_seed: list[dict]) -> list[tuple[float, float]]:
    """(generated tokens, accuracy) per eval step, each the mean over the seeds that reached it."""
    by_step: dict[int, list[dict]] = {}
    for run in per_seed:
        for point in run["curve"]:
            by_step.setdefault(point["step"], []).append(point)
    return [(sum(p["generated_tokens"] for p in points) / len(points), sum(p["accuracy"] for p in points) / len(points))
            for _, points in sorted(by_step.items())]


def plot_tokens(curves: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> Path:
    """Held-out accuracy against cumulative generated tokens, one panel per task; `curves`:
    task -> arm -> (generated tokens, accuracy) per eval, means over seeds."""
    with matplotlib.rc_context(STYLE):
        figure = new_figure(len(curves), "Cures vs GRPO alone: accuracy against generated tokens (mean over seeds)")
        for axes, (task, arms) in zip(figure.axes, curves.items()):
            for index, (name, curve) in enumerate(arms.items()):
                axes.plot([tokens for tokens, _ in curve], [accuracy for _, accuracy in curve], marker="o", markersize=4,
                          color=f"C{index % 10}", linewidth=2.4 if name == REFERENCE else 1.4, label=name)
            decorate(axes, f"{task} task", "held-out accuracy (greedy)", xlabel="generated tokens (student samples)")
        figure.axes[0].legend(loc="best", fontsize=8)
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "cures", help="the runner's --out")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cures" / "report")
    args = parser.parse_args()
    runs = args.runs.resolve()
    restore(runs, [])  # the shipped selection record, when --runs has none
    selection_path = runs / "selection.json"
    selection = json.loads(selection_path.read_text()) if selection_path.is_file() else None
    tasks = comparisons(runs, selection)
    restore(runs, list(tasks.values()))
    longer = longer_config(tasks, task_specs(selection))  # chosen from the tasks' results
    if longer is not None:
        restore(runs, [longer])
    shipped = {task: rows for task, config in tasks.items() if (rows := shipped_rows(task, config)) is not None}
    measured = {task: measure_comparison(config) for task, config in tasks.items() if task not in shipped}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["# Cures for the privileged illusion against GRPO alone", "",
             f"Pre-registered in `experiments/cures/PREREGISTRATION.md`; measured at commit {commit} on a 2-core CPU. "
             "Every interval is over distinct prompts and the three training seeds (two-way random effects).", ""]
    if selection:
        lines += ["## Selecting the sparse task", "", "| candidate | base accuracy | GRPO pilot gain (seed 100) [95% CI] |",
                  "|---|---|---|"]
        for name, seen in selection["candidates"].items():
            gain = seen.get("pilot_gain")
            lines.append(f"| {name}{' (selected)' if name == selection.get('selected') else ''} | "
                         f"{seen.get('base_accuracy', float('nan')):.3f} | "
                         f"{interval(*gain) if gain else 'not needed'} |")
        lines += ["", f"Rule applied: {selection.get('rule', 'not finished')}.", ""]
    summary: dict = {"commit": commit, "selection": selection, "tasks": {}}
    beats, curves, complete = [], {}, len(tasks) == 2
    for task, config in tasks.items():
        if task in shipped:
            rows = shipped[task]
            lines += shipped_task_section(task, rows)
            summary["tasks"][task] = {"from": str(SHIPPED[task].relative_to(ROOT)), "arms": {
                row["name"]: {"loss": row["loss"], "accuracy": row["final"]["value"], "finished": row["finished"],
                              "vs_grpo_only": row["vs_reference"], "fresh_vs_grpo_only": None,
                              "generated_tokens": row["generated_tokens"]} for row in rows}}
            curves[task] = {row["name"]: mean_curve(row["per_seed"]) for row in rows}
            beats += [(task, row["name"]) for row in rows if row["name"] in CURES and row["vs_reference"]
                      and row["vs_reference"]["low"] > 0]
            complete = complete and shipped_complete(rows, config)
            continue
        results = measured[task]
        fresh = {r.name: fresh_change(config, r.name) for r in results if r.name != REFERENCE}
        diagnoses = {r.name: diagnosis(config, r.name) for r in results}
        guards = {r.name: guard_fired(config, r.name) for r in results}
        lines += task_section(task, config, results, fresh, diagnoses, guards)
        summary["tasks"][task] = {r.name: {"loss": r.loss, "accuracy": r.final.value, "finished": r.finished,
                                           "vs_grpo_only": _json(r.vs_reference), "fresh_vs_grpo_only": _json(fresh.get(r.name)),
                                           "generated_tokens": r.generated_tokens, "guard": guards[r.name],
                                           "diagnosis": diagnoses[r.name]} for r in results}
        beats += [(task, r.name) for r in results if r.name in CURES and r.vs_reference and r.vs_reference.low > 0]
        curves[task] = {r.name: [(p.generated_tokens, p.accuracy) for p in r.curve] for r in results}
        complete = complete and grid_complete(results, config)
    figure = plot_tokens(curves, args.out / "cures_accuracy_tokens.png")
    lines += [f"![accuracy against generated tokens]({figure.name})", ""]
    if longer is not None and (longer_results := measure_comparison(longer)):
        lines += longer_section(longer, longer_results)
        summary["longer"] = {r.name: {"steps": r.steps, "seeds": r.seeds, "finished": arm_complete(r, longer),
                                      "accuracy_by_step": {p.step: p.accuracy for p in r.curve},
                                      "vs_grpo_only": _json(r.vs_reference)} for r in longer_results}
    lines += ["## Decision (pre-registered rule)", ""]
    if not complete:
        lines.append("The comparison is not finished: no decision yet.")
    elif not beats:
        lines.append("No cure beat GRPO alone on either task.")
    else:
        lines.append("Beat GRPO alone at the comparison's steps: " + ", ".join(f"`{c}` on the {t} task" for t, c in beats)
                     + ". A recipe ships only if it also holds on fresh prompts and at 3x the steps.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cures_report.md").write_text("\n".join(lines) + "\n")
    (args.out / "cures_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out / 'cures_report.md'}")


def _estimate(value: dict | None) -> str:
    return interval(value["value"], value["low"], value["high"]) if value else ""


def _json(d: PairedDifference | None) -> dict | None:
    return None if d is None else {"mean": d.mean, "low": d.low, "high": d.high, "prompts": d.n, "seeds": d.seeds}


if __name__ == "__main__":
    main()
