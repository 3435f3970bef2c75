"""What the verifier worker's bubblewrap sandbox costs, against the audit-hook-only worker ("limits"):

    python -m experiments.benchmarks.verifier_isolation              # about a minute on 2 cores
    python -m experiments.benchmarks.verifier_isolation --out experiments/benchmarks/results/verifier_isolation.json

Each round starts a fresh worker in one mode and times its start-up (spawn to the first reply, which
includes importing math-verify and sympy), importing reasoning-gym (the setup task), then --answers
math-verify checks and --answers reasoning-gym scores, each a round trip to the warm worker. Rounds
alternate the two modes (sandbox first, then limits, --rounds times), so both see the same machine;
the first pair warms the file cache and is left out. The medians over the remaining rounds (per
answer: over every answer) and their ratio sandbox / limits are the result. `others_cores` says
how busy the rest of the machine was meanwhile (shared machines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import reasoning_gym

from experiments.benchmarks.cpu_load import others_cores, snapshot
from selfopd.verifiers import isolation, run_in_worker, shutdown_workers, timeout

ROOT = Path(__file__).resolve().parents[2]
MODES = ("sandbox", "limits")
# Pairs math-verify really has to compare (no plain numbers: those never reach the worker).
MATH_PAIRS = [(r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"), (r"x^2+2x+1", r"(x+1)^2"), (r"\sqrt{8}", r"2\sqrt{2}"),
              (r"\frac{\pi}{3}", r"60^\circ"), (r"\{1, 2\}", r"\{2, 1\}"), (r"2^{10}", r"1000")]
TASK = "polynomial_multiplication"  # its scorer parses the answer with sympy: a real scorer's work


def one_round(mode: str, answers: int, entries: list[dict]) -> dict:
    """Start-up and per-answer seconds of one fresh worker in `mode`."""
    timeout.set_isolation(mode)
    shutdown_workers()
    start = snapshot()
    began = time.perf_counter()
    run_in_worker("echo", None, timeout_s=120)
    startup = time.perf_counter() - began
    began = time.perf_counter()
    run_in_worker("import_reasoning_gym", timeout_s=120)
    rg_import = time.perf_counter() - began
    math_s, rg_s = [], []
    for i in range(answers):
        pred, ref = MATH_PAIRS[i % len(MATH_PAIRS)]
        began = time.perf_counter()
        run_in_worker("math_verify", pred, ref, timeout_s=60)
        math_s.append(time.perf_counter() - began)
        entry = entries[i % len(entries)]
        began = time.perf_counter()
        score = run_in_worker("reasoning_gym_score", TASK, entry["answer"], entry, timeout_s=60)
        rg_s.append(time.perf_counter() - began)
        assert score == 1.0, f"{mode}: the reference answer scored {score}"
    shutdown_workers()
    return {"mode": mode, "startup_s": startup, "import_reasoning_gym_s": rg_import, "math_verify_s": math_s,
            "reasoning_gym_score_s": rg_s, "others_cores": others_cores(start, snapshot())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/verifier_isolation.json")
    parser.add_argument("--rounds", type=int, default=6, help="sandbox + limits pairs after the warm-up pair")
    parser.add_argument("--answers", type=int, default=30, help="math-verify checks and reasoning-gym scores per round")
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "verifier_isolation.json"
    reason = isolation.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no sandbox here to measure: {reason}")
    entries = list(reasoning_gym.create_dataset(TASK, size=10, seed=1))
    timeout.MAX_WORKERS = 1  # one worker per round: the one whose start-up is timed
    rounds = []
    try:
        for index in range(args.rounds + 1):
            for mode in MODES:
                rounds.append({"round": index, **one_round(mode, args.answers, entries)})
                summary = {k: round(v if isinstance(v, float) else statistics.median(v), 4)
                           for k, v in rounds[-1].items() if k.endswith("_s")}
                print(json.dumps({"round": index, "mode": mode, **summary}), flush=True)
    finally:
        timeout.set_isolation(None)
    measured = [r for r in rounds if r["round"] > 0]
    keys = ("startup_s", "import_reasoning_gym_s", "math_verify_s", "reasoning_gym_score_s")

    def median(mode: str, key: str) -> float:
        values = [r[key] for r in measured if r["mode"] == mode]
        return statistics.median(v for value in values for v in (value if isinstance(value, list) else [value]))

    medians = {mode: {key: median(mode, key) for key in keys} for mode in MODES}
    bwrap = subprocess.run([isolation.bwrap_path() or "bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    report = {"what": "verifier worker: bubblewrap sandbox vs audit-hook-only limits", "bwrap": bwrap,
              "as_root": os.geteuid() == 0, "cpus": os.cpu_count(), "python": platform.python_version(),
              "rounds": args.rounds, "answers_per_round": args.answers, "task": TASK,
              "median": medians,
              "ratio_sandbox_over_limits": {key: medians["sandbox"][key] / medians["limits"][key] for key in keys},
              "added_seconds": {key: medians["sandbox"][key] - medians["limits"][key] for key in keys},
              "others_cores_median": statistics.median(r["others_cores"] for r in measured),
              "rounds_measured": measured}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: report[key] for key in ("median", "ratio_sandbox_over_limits", "added_seconds",
                                                    "others_cores_median")}, indent=2), f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
