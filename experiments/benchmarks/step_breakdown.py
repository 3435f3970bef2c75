"""Seconds per phase of one OPD step, and the toolkit's own overhead.

    python -m experiments.benchmarks.step_breakdown                       # the demo config
    python -m experiments.benchmarks.step_breakdown --steps 5 --set rollout.max_tokens=32

Phases: sample (student rollouts), verify (rewards + teacher prompt rendering), teacher
(scoring), train (student forward/backward), optim, sync, probe. Overhead = step time
minus the phases: data selection, prompt tokenisation, metrics, rollout logging. Target:
under 5% of the step. One warm-up step is run first and left out. Run nothing else on the
machine meanwhile: shares measured in one run are what to compare, not absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from selfopd.config import load_config
from selfopd.core.run_folder import portable_path
from selfopd.training.trainer import build_run, train_step

PHASES = ("sample", "verify", "teacher", "train", "optim", "sync", "probe", "overhead")
ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "experiments" / "demo" / "demo.toml")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "step_breakdown.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(args.config, [*args.overrides, f"run.out_dir={scratch}", "run.rollouts_to_save=8"])
        run = build_run(config)
        run.run_dir.mkdir(parents=True)
        train_step(run)  # warm-up: first-call allocations and lazy imports
        steps = [train_step(run) for _ in range(args.steps)]

    step_seconds = statistics.mean(m["time/step"] for m in steps)
    rows = []
    for phase in PHASES:
        seconds = statistics.mean(m.get(f"time/{phase}", 0.0) for m in steps)
        rows.append({"phase": phase, "seconds": seconds, "share": seconds / step_seconds})
    print(f"{'phase':<10}{'seconds':>10}{'share':>9}")
    for row in rows:
        print(f"{row['phase']:<10}{row['seconds']:>10.3f}{row['share']:>9.1%}")
    print(f"{'step':<10}{step_seconds:>10.3f}{1:>9.0%}")
    overhead = rows[-1]["share"]
    print(f"overhead {overhead:.2%} of the step: {'within' if overhead < 0.05 else 'ABOVE'} the 5% target")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": portable_path(args.config), "overrides": args.overrides, "steps": args.steps,
                                    "step_seconds": step_seconds, "phases": rows,
                                    "tokens_per_step": statistics.mean(m["tokens/completion"] for m in steps)}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
