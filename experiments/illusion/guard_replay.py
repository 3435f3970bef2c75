"""Replay the illusion guard offline on finished runs and set where it fires next to what
each run did to held-out accuracy: the guard's calibration evidence (docs/results/illusion.md).

    python -m experiments.illusion.guard_replay runs/templates_trained/arms [--set guard.window=6 ...]

Every run folder under the given folders (one with a metrics.jsonl) is replayed with its own
config's [guard] (runs made before the guard get its defaults) and the --set overrides; steps
logged before the trainer reported the teacher-prefers-correct sums take them from the saved
rollouts. Prints one markdown row per run and writes the rows as JSON (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from selfopd.core.atomic import write_json_atomic
from selfopd.config import load_config, parse_overrides
from selfopd.training.guard import replay, training_lines
from selfopd.core.plots import read_metrics
from selfopd.core.run_folder import RunFolder


def replay_run(run_dir: Path, overrides: list[str]) -> dict:
    folder = RunFolder(run_dir)
    config = load_config(folder.config, overrides)
    lines = read_metrics(folder.metrics)
    evals = [line for line in lines if "eval/accuracy" in line]
    fired = replay(run_dir, overrides)
    return {
        "run": str(run_dir), "template": config.teacher.template, "seed": config.run.seed,
        "steps": len(training_lines(lines)),
        "held_out_first": evals[0]["eval/accuracy"] if evals else None,
        "held_out_last": evals[-1]["eval/accuracy"] if evals else None,
        "held_out_change": evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] if len(evals) > 1 else None,
        "events": [dataclasses.asdict(event) for event in fired],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="guard.KEY=VALUE")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    parse_overrides(args.overrides)  # a typo fails here, naming the key
    runs = sorted({path.parent for folder in args.folders for path in folder.rglob("metrics.jsonl")})
    rows = [replay_run(run, args.overrides) for run in runs]
    print("| run | teacher template | steps | held-out change | guard fires (step: condition) |")
    print("|---|---|---|---|---|")
    for row in rows:
        change = "n/a" if row["held_out_change"] is None else f"{row['held_out_change']:+.3f}"
        fires = ", ".join(f"{e['step']}: {e['condition']}" for e in row["events"]) or "no"
        print(f"| {row['run']} | {row['template']} | {row['steps']} | {change} | {fires} |")
    if args.out:
        write_json_atomic(args.out, {"overrides": args.overrides, "runs": rows})


if __name__ == "__main__":
    main()
