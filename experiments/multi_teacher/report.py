"""The two-teacher study's numbers (PREREGISTRATION.md), from its runs.

    python -m experiments.multi_teacher.report                              # runs/multi_teacher/
    python -m experiments.multi_teacher.report --out-dir experiments/results  # the shipped copy

Restores the finished runs kept in results/multi_teacher_runs.tar.xz (so it works on a fresh
clone). The run's eval holds both tasks' held-out prompts; each measure reads one task's, by the
eval records' ids ("kb:countries/..." or "basic_arithmetic/...").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from selfopd.comparisons.compare import CompareConfig, load_compare_config
from selfopd.comparisons.records import restore_runs
from selfopd.core.atomic import write_text_atomic
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import PairedDifference, pooled_accuracy, pooled_change
from selfopd.run.evaluate import outcomes_by_prompt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARCHIVE = HERE / "results" / "multi_teacher_runs.tar.xz"
TASKS = {"arithmetic": "basic_arithmetic/", "knowledge (b)": "kb:countries/"}
Outcomes = dict[str, list[bool]]


def task_outcomes(run_dir: Path, step: int, prefix: str) -> Outcomes:
    """One task's held-out outcomes at one eval of a run, by prompt."""
    path = RunFolder(run_dir).eval_dir(step) / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return outcomes_by_prompt([row for row in rows if row["id"].startswith(prefix)])


def finished_seeds(config: CompareConfig, arm: str) -> list[int]:
    return [seed for seed in config.seeds if RunFolder(config.arm_dir(arm, seed)).finished.is_file()]


def task_table(config: CompareConfig, steps: int) -> list[str]:
    reference = config.reference
    other = [arm.name for arm in config.arms if arm.name != reference]
    lines = ["| task | arm | seeds | at step 0 | at the last step | vs step 0 [95%] | "
             f"vs `{reference}` [95%] |", "|---|---|---|---|---|---|---|"]
    for task, prefix in TASKS.items():
        for arm in [reference, *other]:
            seeds = finished_seeds(config, arm)
            if not seeds:
                lines.append(f"| {task} | `{arm}` | none finished | | | | |")
                continue
            start = {s: task_outcomes(config.arm_dir(arm, s), 0, prefix) for s in seeds}
            last = {s: task_outcomes(config.arm_dir(arm, s), steps, prefix) for s in seeds}
            both = [s for s in seeds if s in finished_seeds(config, reference)]
            versus = "(reference)" if arm == reference else _change(pooled_change(
                [(task_outcomes(config.arm_dir(reference, s), steps, prefix), last[s]) for s in both]) if both else None)
            lines.append(f"| {task} | `{arm}` | {', '.join(map(str, seeds))} | {_accuracy(start)} | {_accuracy(last)} "
                         f"| {_change(pooled_change([(start[s], last[s]) for s in seeds]))} | {versus} |")
    return lines


def teacher_table(config: CompareConfig) -> list[str]:
    """Per arm and teacher, over every step of every finished seed: the means of its metrics."""
    lines = ["| arm | teacher | token share | advantage mean | reverse KL | steps with no tokens |",
             "|---|---|---|---|---|---|"]
    for arm in (a.name for a in config.arms):
        rows = [row for seed in finished_seeds(config, arm)
                for row in map(json.loads, (config.arm_dir(arm, seed) / "metrics.jsonl").read_text().splitlines())
                if "step" in row and "time/step" in row]
        names = sorted({key.split("/")[1] for row in rows for key in row
                        if key.startswith("teacher/") and key.endswith("/token_share")})
        for name in names:
            def mean(metric: str) -> str:
                values = [row[f"teacher/{name}/{metric}"] for row in rows if f"teacher/{name}/{metric}" in row]
                return f"{np.mean(values):.3f}" if values else "none"
            starved = sum(row.get(f"teacher/{name}/token_share", 1.0) == 0.0 for row in rows)
            lines.append(f"| `{arm}` | `{name}` | {mean('token_share')} | {mean('advantage_mean')} | "
                         f"{mean('reverse_kl')} | {starved} of {len(rows)} |")
        if not names:
            lines.append(f"| `{arm}` | one teacher (no per-teacher metrics) | 1 | | | |")
    return lines


def drift_lines(config: CompareConfig) -> list[str]:
    """Each run's drift (`selfopd drift --out RUN/drift`, run while its weights were on disk)."""
    lines = []
    for arm in (a.name for a in config.arms):
        values = []
        for seed in finished_seeds(config, arm):
            path = config.arm_dir(arm, seed) / "drift" / "summary.json"
            if path.is_file():
                values.append(json.loads(path.read_text())["kl"]["value"])
        lines.append(f"- `{arm}`: " + (", ".join(f"{v:.3f}" for v in values) + f" (mean {np.mean(values):.3f})"
                                        if values else "not measured"))
    return lines


def _accuracy(per_seed: dict[int, Outcomes]) -> str:
    value = pooled_accuracy([per_seed[s] for s in sorted(per_seed)])
    return f"{value.value:.3f} [{value.low:.3f}, {value.high:.3f}]"


def _change(d: PairedDifference | None) -> str:
    return "not yet run" if d is None else f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "multi_teacher")
    args = parser.parse_args()
    config = load_compare_config(HERE / "compare.toml")
    restore_runs(config, ARCHIVE / config.name)
    steps = max((RunFolder(config.arm_dir(a.name, s)).eval_steps() or [0])[-1] for a, s in
                ((a, s) for a in config.arms for s in config.seeds) if config.arm_dir(a.name, s).is_dir())
    lines = ["# Two teachers in one run: the numbers", "",
             "Pre-registered in `experiments/multi_teacher/PREREGISTRATION.md`; written by "
             "`python -m experiments.multi_teacher.report`. Held out: the demo's 200 distinct sums and the "
             "knowledge task's 64 distinct other phrasings of its trained facts; no run trains on any of them. "
             "Intervals are 95% over prompts x seeds; step 0 is the start model.", "",
             "## Held-out accuracy by task", "", *task_table(config, steps), "",
             "## Each teacher, averaged over steps and seeds", "", *teacher_table(config), "",
             "## Drift: KL(trained || start) per token on 48 general prompts, per seed", "", *drift_lines(config)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = write_text_atomic(args.out_dir / "multi_teacher_report.md", "\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
