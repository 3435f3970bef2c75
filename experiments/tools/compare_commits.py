"""Step time of one config at two commits, measured alternately in one run.

    python -m experiments.tools.compare_commits BEFORE AFTER                 # the demo config
    python -m experiments.tools.compare_commits c987af4 HEAD --rounds 3 --steps 3 --set rollout.max_tokens=32

Each commit is checked out into a temporary git worktree; every round runs
`experiments/benchmarks/step_breakdown.py` (one warm-up step, then `--steps` measured) from
the BEFORE tree, then from the AFTER tree, with this environment's Python and that tree's
`selfopd` first on the path. Reported: each side's median step and phase seconds over the
rounds, and the AFTER / BEFORE ratio of the step within each round (min, median, max): on a
shared machine ratios measured side by side are what to compare, not absolute seconds.
Writes JSON (runs/benchmarks/compare_commits.json unless --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def resolved(revision: str) -> str:
    """The short commit hash a revision (HEAD, a branch, a tag) names now."""
    done = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def worktree(revision: str, scratch: Path) -> Path:
    folder = scratch / revision
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), revision], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def breakdown(tree: Path, config: Path, steps: int, overrides: list[str], out: Path) -> dict:
    command = [sys.executable, str(tree / "experiments" / "benchmarks" / "step_breakdown.py"), "--config", str(config),
               "--steps", str(steps), "--out", str(out), *[arg for item in overrides for arg in ("--set", item)]]
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: step_breakdown failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["config"] = portable(config)
    return result


def portable(config: Path) -> str:
    """The config as the report names it: relative to the checkout, so result files read the same everywhere."""
    return str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else config.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--config", type=Path, default=ROOT / "experiments" / "demo" / "demo.toml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "compare_commits.json")
    args = parser.parse_args()
    args.before, args.after = resolved(args.before), resolved(args.after)
    scratch = Path(tempfile.mkdtemp(prefix="compare_commits-"))
    trees = {"before": worktree(args.before, scratch), "after": worktree(args.after, scratch)}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for number in range(1, args.rounds + 1):
            for side, tree in trees.items():
                print(f"round {number}: {side} ({getattr(args, side)}) ...", flush=True)
                results[side].append(breakdown(tree, args.config.resolve(), args.steps, args.overrides,
                                               scratch / f"{side}-{number}.json"))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    ratios = [a["step_seconds"] / b["step_seconds"] for b, a in zip(results["before"], results["after"])]
    summary = {}
    for side, runs in results.items():
        phases = {p["phase"] for run in runs for p in run["phases"]}
        summary[side] = {"revision": getattr(args, side), "step_s": statistics.median(r["step_seconds"] for r in runs),
                         "phases_s": {name: statistics.median(next((p["seconds"] for p in r["phases"]
                                                                    if p["phase"] == name), 0.0) for r in runs)
                                      for name in sorted(phases)}}
    report = {"config": portable(args.config.resolve()),
              "overrides": args.overrides, "rounds": args.rounds, "steps": args.steps, "summary": summary,
              "after_over_before": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
              "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for side, values in summary.items():
        phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in values["phases_s"].items())
        print(f"{side:<7}{values['revision']:<12} step {values['step_s']:.2f} s: {phases}")
    ratio = report["after_over_before"]
    print(f"after / before, per round: {ratio['min']:.2f} / {ratio['median']:.2f} / {ratio['max']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
