"""Learning with rollouts one step old: `rollout.max_staleness = 1` against the synchronous loop.

    selfopd compare experiments/staleness/compare.toml \
        --keep-records experiments/staleness/results/staleness_runs.tar.xz        # 2 arms x 3 seeds
    python -m experiments.staleness.report                                  # -> runs/staleness_demo/
    python -m experiments.staleness.report --out experiments/staleness/results  # the shipped copy

Reads the comparison's run folders, first restoring the finished runs they lack from the study's
archive of records (`--records`), and adds to what `selfopd compare` reports of the final step:
held-out accuracy of both arms at every eval step, pooled over seeds; the paired change at equal
steps; the paired change at equal wall time, pairing the pipelined arm's step t with the
synchronous arm's eval step nearest t / speed-up, the speed-up measured with servers by
`experiments/benchmarks/staleness_overlap.py` (both arms train in process here, where k = 1 gives
the rollouts of a one-step pipeline without its overlap); and per step the staleness and the
importance ratio statistics. The unit is the distinct held-out prompt, pooled over seeds
(prompt x seed interval); the script checks that no held-out prompt was trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from selfopd.comparisons.compare import load_compare_config
from selfopd.comparisons.compare_report import eval_outcomes
from selfopd.comparisons.records import restore_runs
from selfopd.core.plots import new_figure, read_metrics, save_figure
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import pooled_accuracy, pooled_change
from selfopd.data.split import SplitRecord

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RATIO_KEYS = ("rollout/staleness", "is/ratio_mean", "is/ratio_max", "is/clipped_share", "opd/reverse_kl")


def check_held_out(run_dirs: list[Path]) -> int:
    """The number of distinct held-out prompts; refused if any was a training prompt of any run."""
    counts = set()
    for run_dir in run_dirs:
        split = SplitRecord.read(run_dir)
        trained = set(split.eval_prompts) & set(split.train_prompts)
        if trained:
            raise SystemExit(f"{run_dir}: {len(trained)} held-out prompts were training prompts")
        counts.add(len(set(split.eval_prompts)))
    if len(counts) != 1:
        raise SystemExit(f"the runs hold different held-out sets: {sorted(counts)} distinct prompts")
    return counts.pop()


def step_means(run_dirs: list[Path]) -> dict[int, dict[str, float]]:
    """Per training step, each ratio statistic's mean over the seeds."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for run_dir in run_dirs:
        for line in read_metrics(RunFolder(run_dir).metrics):
            if "loss/pg" in line:
                row = by_step.setdefault(line["step"], {})
                for key in RATIO_KEYS:
                    row.setdefault(key, []).append(float(line.get(key, 0.0)))
    return {step: {key: float(np.mean(values)) for key, values in row.items()} for step, row in sorted(by_step.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, default=HERE / "compare.toml")
    parser.add_argument("--records", type=Path, default=HERE / "results" / "staleness_runs.tar.xz",
                        help="the records --keep-records kept (a folder or a .tar.xz archive)")
    parser.add_argument("--speed", type=Path, default=ROOT / "experiments" / "benchmarks" / "results" /
                        "staleness_overlap.json", help="the overlap benchmark's JSON (its k = 1 speed-up)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="the comparison's --set values, as given to selfopd compare")
    parser.add_argument("--seeds", default="", help="comma-separated seeds, as given to selfopd compare")
    parser.add_argument("--name", default="", help="the comparison's folder name, as given to selfopd compare")
    parser.add_argument("--out", type=Path, help="folder for staleness_report.md/.json/.png "
                        "(default: the comparison's folder)")
    args = parser.parse_args()
    compare = load_compare_config(args.compare, args.overrides, (), [int(s) for s in args.seeds.split(",") if s])
    if args.name:
        compare = dataclasses.replace(compare, name=args.name)
    reference, other = compare.arms[0].name, compare.arms[1].name
    for run_dir in restore_runs(compare, args.records) if args.records.exists() else []:
        print(f"restored {run_dir} from {args.records}")
    runs = {arm.name: [compare.arm_dir(arm.name, seed) for seed in compare.seeds] for arm in compare.arms}
    missing = [str(d) for dirs in runs.values() for d in dirs if not RunFolder(d).finished.is_file()]
    if missing:
        raise SystemExit(f"unfinished runs (run `selfopd compare {args.compare}` first): {missing}")
    prompts = check_held_out([d for dirs in runs.values() for d in dirs])
    speedup = next(r["speedup"] for r in json.loads(args.speed.read_text())["rows"] if r["max_staleness"] == 1)
    steps = sorted(set.intersection(*(set(RunFolder(d).eval_steps()) for dirs in runs.values() for d in dirs)))

    def outcomes(arm: str, step: int) -> list:
        return [eval_outcomes(d, step) for d in runs[arm]]

    accuracy = {arm: {s: pooled_accuracy(outcomes(arm, s)) for s in steps} for arm in runs}
    equal_steps = {s: pooled_change(list(zip(outcomes(reference, s), outcomes(other, s)))) for s in steps if s}
    equal_time = {}
    for s in steps:
        partner = min(steps, key=lambda t: (abs(t - s / speedup), t))
        if s and partner != s:
            equal_time[s] = (partner, pooled_change(list(zip(outcomes(reference, partner), outcomes(other, s)))))
    ratios = {arm: step_means(dirs) for arm, dirs in runs.items()}

    seeds = len(compare.seeds)
    lines = ["# Learning with rollouts one step old (`rollout.max_staleness = 1`)", "",
             f"`{other}` against `{reference}` on the demo task, {seeds} seeds, {prompts} distinct held-out prompts "
             f"(none trained on), greedy evals; intervals over prompts x seeds, 95%. Made by "
             f"`python -m experiments.staleness.report` from `{compare.folder.relative_to(ROOT) if compare.folder.is_relative_to(ROOT) else compare.folder}`.",
             "", "## Held-out accuracy", "", f"| step | {reference} | {other} | change at equal steps |", "|---|---|---|---|"]
    for s in steps:
        change = str(equal_steps[s]) + f" ({equal_steps[s].verdict})" if s in equal_steps else ""
        lines.append(f"| {s} | {accuracy[reference][s]} | {accuracy[other][s]} | {change} |")
    lines += ["", f"## At equal wall time ({speedup:.2f}x per step with servers)", "",
              f"| {other} at step | {reference} at step | change |", "|---|---|---|"]
    lines += [f"| {s} | {partner} | {change} ({change.verdict}) |" for s, (partner, change) in equal_time.items()]
    lines += ["", "## Staleness and importance ratios per step (mean over seeds)", "",
              "| step | " + " | ".join(f"{arm}: {key}" for arm in runs for key in RATIO_KEYS[1:4]) + " |",
              "|---|" + "---|" * (3 * len(runs))]
    for step in sorted(ratios[reference]):
        lines.append(f"| {step} | " + " | ".join(f"{ratios[arm][step][key]:.4f}" for arm in runs
                                                   for key in RATIO_KEYS[1:4]) + " |")

    out = args.out or compare.folder
    out.mkdir(parents=True, exist_ok=True)
    figure = new_figure(2, "")
    left, right = figure.axes
    for arm in runs:
        scale = speedup if arm == other else 1.0
        values = [accuracy[arm][s] for s in steps]
        for axes, x in ((left, steps), (right, [s / scale for s in steps])):
            axes.plot(x, [v.value for v in values], marker="o", label=arm)
            axes.fill_between(x, [v.low for v in values], [v.high for v in values], alpha=0.15)
    left.set(xlabel="step", ylabel="held-out accuracy", title="equal steps")
    right.set(xlabel="synchronous-step equivalents of wall time", title=f"equal wall time ({speedup:.2f}x)")
    left.legend()
    save_figure(figure, out / "staleness_report.png")
    lines += ["", "![accuracy at equal steps and at equal wall time](staleness_report.png)", ""]
    (out / "staleness_report.md").write_text("\n".join(lines))
    (out / "staleness_report.json").write_text(json.dumps({
        "reference": reference, "arm": other, "seeds": compare.seeds, "distinct_prompts": prompts, "speedup": speedup,
        "accuracy": {arm: {s: vars(v) for s, v in by.items()} for arm, by in accuracy.items()},
        "equal_steps": {s: vars(c) for s, c in equal_steps.items()},
        "equal_wall_time": {s: {"reference_step": p, **vars(c)} for s, (p, c) in equal_time.items()},
        "per_step": ratios}, indent=2))
    print("\n".join(lines))
    print(f"wrote {out / 'staleness_report.md'}")


if __name__ == "__main__":
    main()
