"""The cross-tokenizer study's numbers (PREREGISTRATION.md), from its runs.

    python -m experiments.cross_tokenizer.report                              # runs/cross_tokenizer/
    python -m experiments.cross_tokenizer.report --out-dir experiments/results  # the shipped copy

Restores the finished runs kept in results/cross_tokenizer_runs.tar.xz (so it works on a fresh
clone), writes each comparison's own report (`selfopd compare`'s), and adds what that report
does not show: the share of completions the teacher could not read, and seconds per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from selfopd.comparisons.compare import CompareConfig, load_compare_config
from selfopd.comparisons.compare_report import ArmResult, measure_comparison, write_compare_report
from selfopd.comparisons.records import restore_runs
from selfopd.core.atomic import write_text_atomic

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARCHIVE = HERE / "results" / "cross_tokenizer_runs.tar.xz"
COMPARISONS = {"cross_tokenizer": (), "cross_tokenizer_lr3e-5": ("optim.lr=3e-5",)}  # amendment 2: exploratory


def comparison(name: str, overrides: tuple[str, ...]) -> CompareConfig:
    config = load_compare_config(HERE / "compare.toml", list(overrides))
    return dataclasses.replace(config, name=name)


def metric_over_steps(config: CompareConfig, arm: str, key: str) -> list[float]:
    """Every step's value of one metric, over the arm's finished seeds."""
    values = []
    for seed in config.seeds:
        path = config.arm_dir(arm, seed) / "metrics.jsonl"
        if path.is_file():
            values += [row[key] for row in map(json.loads, path.read_text().splitlines()) if key in row]
    return values


def arm_lines(config: CompareConfig, results: list[ArmResult]) -> list[str]:
    lines = ["| arm | seeds | held-out at the last step | vs the start [95%] | vs `grpo_only` [95%] "
             "| unreadable completions: mean / max share a step | median seconds a step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        unaligned = metric_over_steps(config, r.name, "teacher/unaligned_share")
        seconds = metric_over_steps(config, r.name, "time/step")
        lines.append(
            f"| `{r.name}` | {', '.join(map(str, r.seeds))} | {r.final.value:.3f} [{r.final.low:.3f}, {r.final.high:.3f}] "
            f"| {_change(r.vs_base)} | {'(reference)' if r.vs_reference is None else _change(r.vs_reference)} "
            f"| {np.mean(unaligned):.3f} / {np.max(unaligned):.3f} | {np.median(seconds):.2f} |"
            if unaligned and seconds else f"| `{r.name}` | {', '.join(map(str, r.seeds))} | not finished | | | | |")
    return lines


def _change(d) -> str:
    return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "cross_tokenizer")
    args = parser.parse_args()
    lines = ["# Cross-tokenizer on-policy distillation: the numbers", "",
             "Pre-registered in `experiments/cross_tokenizer/PREREGISTRATION.md`; written by "
             "`python -m experiments.cross_tokenizer.report`. Held out: the demo's 200 distinct sums, none "
             "trained on by the student or the teacher; intervals are 95% over prompts x seeds."]
    for name, overrides in COMPARISONS.items():
        config = comparison(name, overrides)
        restore_runs(config, ARCHIVE / name)
        results = measure_comparison(config)
        if not results:
            continue
        report = write_compare_report(config)
        label = "registered" if not overrides else f"exploratory, amendment 2: {', '.join(overrides)}"
        start = results[0].curve[0]
        lines += ["", f"## `{name}` ({label})", "",
                  f"Start (the warm-started student): {start.accuracy:.3f} [{start.low:.3f}, {start.high:.3f}]. "
                  f"`selfopd compare`'s own report: `{report}`.", "", *arm_lines(config, results)]
    out = args.out_dir / "cross_tokenizer_report.md"
    write_text_atomic(out, "\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
