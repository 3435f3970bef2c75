"""The pre-registered code comparison (experiments/code/PREREGISTRATION.md), stage by stage.

    python -m experiments.code.run                  # every stage, in order; rerun to resume
    python -m experiments.code.run --stage select   # or one: select, compare, report

Stages:
  select   the task: each candidate's greedy start rate (measure_start.py), first in [0.10, 0.40]
  compare  3 arms x seeds 0-2 (`selfopd compare`'s runner: finished runs are skipped)
  report   `selfopd compare`'s report, then the hidden-test measures (results/code_sdpo_report.md)

Runs are written under --out (default runs/code). The measurements and the report are kept in
experiments/code/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from selfopd.comparisons.compare import CompareConfig, load_compare_config, run_compare
from selfopd.comparisons.compare_report import write_compare_report
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import pooled_change

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPARE = HERE / "compare.toml"
RESULTS = HERE / "results"
SELECTION = RESULTS / "code_selection.json"
CANDIDATES = ("2+3", "2", "3")  # the pre-registered order
RATE_RANGE, FALLBACK_TARGET = (0.10, 0.40), 0.25
TRAIN_DATA = "codegen?level={level}&size=400&seed=1"
FINAL_STEP = 8


def select() -> str:
    """The task's level by the pre-registered rule; each candidate measured once (kept in SELECTION)."""
    record = json.loads(SELECTION.read_text()) if SELECTION.exists() else {"rates": {}}
    for level in CANDIDATES:
        if level not in record["rates"]:
            out = RESULTS / f"code_start_{level.replace('+', '_')}.json"
            subprocess.run([sys.executable, "-m", "experiments.code.measure_start", "--levels", level, "--items", "64",
                            "--max-tokens", "128", "--seed", "0", "--out", str(out)], check=True, cwd=ROOT)
            record["rates"][level] = json.loads(out.read_text())["levels"][level]["shown_rate"]
            _write(SELECTION, record)
        if RATE_RANGE[0] <= record["rates"][level] <= RATE_RANGE[1]:
            record["selected"] = level
            break
    else:
        record["selected"] = min(record["rates"], key=lambda lv: abs(record["rates"][lv] - FALLBACK_TARGET))
    _write(SELECTION, record)
    print(f"task: codegen level {record['selected']} (start rates {record['rates']})", flush=True)
    return record["selected"]


def comparison(level: str, out: Path) -> CompareConfig:
    config = load_compare_config(COMPARE, [f"data.spec={TRAIN_DATA.format(level=level)}"])
    return dataclasses.replace(config, out_dir=out)


def hidden_outcomes(eval_dir: Path) -> tuple[dict[str, list[bool]], dict[str, list[bool]]]:
    """Per held-out function: (all shown tests passed, all hidden tests passed) of an eval folder."""
    shown: dict[str, list[bool]] = {}
    hidden: dict[str, list[bool]] = {}
    for line in (eval_dir / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        shown.setdefault(row["id"], []).append(bool(row["correct"]))
        hidden.setdefault(row["id"], []).append(row.get("hidden_reward") == 1.0)
    return shown, hidden


def report(config: CompareConfig) -> Path:
    """`selfopd compare`'s report, then the pre-registered hidden-test measures beside it."""
    write_compare_report(config)
    lines = ["# Code self-distillation: hidden tests (pre-registered secondary measures)", "",
             f"Held-out functions per eval: {_count(config)}, none trained on; seeds {list(config.seeds)}; "
             f"step {FINAL_STEP} against step 0 and against `{config.reference}`.", "",
             "| arm | shown pass, step 8 | hidden pass, step 8 | hidden change vs reference | "
             "gap (shown - hidden) change from step 0 |", "|---|---|---|---|---|"]
    finals = {arm.name: {seed: _eval(config, arm.name, seed, FINAL_STEP) for seed in config.seeds} for arm in config.arms}
    starts = {arm.name: {seed: _eval(config, arm.name, seed, 0) for seed in config.seeds} for arm in config.arms}
    for arm in config.arms:
        shown = [_mean(finals[arm.name][s][0]) for s in config.seeds]
        hidden = [_mean(finals[arm.name][s][1]) for s in config.seeds]
        versus = "reference" if arm.name == config.reference else _interval(pooled_change(
            [(finals[config.reference][s][1], finals[arm.name][s][1]) for s in config.seeds]))
        gap_change = pooled_change([(_gap(*starts[arm.name][s]), _gap(*finals[arm.name][s])) for s in config.seeds])
        lines.append(f"| {arm.name} | {sum(shown) / len(shown):.3f} | {sum(hidden) / len(hidden):.3f} | {versus} | "
                     f"{_interval(gap_change)} |")
    path = config.folder / "hidden_report.md"
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text(), flush=True)
    return path


def _eval(config: CompareConfig, arm: str, seed: int, step: int) -> tuple[dict, dict]:
    return hidden_outcomes(RunFolder(config.arm_dir(arm, seed)).eval_dir(step))


def _gap(shown: dict[str, list[bool]], hidden: dict[str, list[bool]]) -> dict[str, list[float]]:
    """Per function: shown pass minus hidden pass, as a one-sample outcome for `pooled_change`."""
    return {key: [sum(shown[key]) / len(shown[key]) - sum(hidden[key]) / len(hidden[key])] for key in shown}


def _mean(outcomes: dict[str, list]) -> float:
    means = [sum(v) / len(v) for v in outcomes.values()]
    return sum(means) / max(len(means), 1)


def _interval(change) -> str:
    return f"{change.mean:+.3f} [{change.low:+.3f}, {change.high:+.3f}]"


def _count(config: CompareConfig) -> int:
    arm = config.arms[0].name
    return len(_eval(config, arm, config.seeds[0], FINAL_STEP)[0])


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("all", "select", "compare", "report"), default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "code")
    args = parser.parse_args()
    level = select()
    config = comparison(level, args.out)
    if args.stage in ("all", "compare"):
        run_compare(config)
    if args.stage in ("all", "report"):
        report(config)


if __name__ == "__main__":
    main()
