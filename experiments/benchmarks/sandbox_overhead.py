"""What running a model-written program in the code sandbox costs (`selfopd.verifiers.code_runner`):

    python -m experiments.benchmarks.sandbox_overhead              # about a minute on 2 cores
    python -m experiments.benchmarks.sandbox_overhead --out experiments/benchmarks/results/sandbox_overhead.json

Per test run, one at a time: an empty program (its whole cost is start-up: bwrap, the namespaces,
the launcher's rlimits, Python) run by `run_test` against a stdin test, against the same program
run by a bare `subprocess.run` of the same interpreter (no sandbox, no limits, no harness), and a
call test (the harness imports the program, then calls it). Rounds alternate the three, --runs
each; the first round warms the file cache and is left out; medians over the rest. Then tests per
second through `run_tests` on --workers threads (2: the cores a CI machine has) for --tests tests.
`others_cores` says how busy the rest of the machine was before the measurement (shared machines;
a sandbox's own processes are not this process's children once they end, so no measurement during).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.benchmarks.cpu_load import others_cores, snapshot
from selfopd.verifiers import isolation
from selfopd.verifiers.code_runner import CodeLimits, run_test, run_tests

ROOT = Path(__file__).resolve().parents[2]
EMPTY = ""
STDIN_TEST = {"stdin": "", "stdout": ""}
CALL_PROGRAM = "def add(a, b):\n    return a + b\n"
CALL_TEST = {"call": "add(1, 2)", "expected": "3"}


def bare_seconds(program: str) -> float:
    """One run of `program` by a plain child process, as run_test does it minus the sandbox."""
    folder = Path(tempfile.mkdtemp(prefix="selfopd-bench-"))
    try:
        began = time.perf_counter()
        (folder / "solution.py").write_text(program)
        done = subprocess.run([os.path.realpath(sys.executable), "-I", "-B", "solution.py"], cwd=folder, input=b"",
                              capture_output=True, timeout=60, env={"PYTHONDONTWRITEBYTECODE": "1"})
        seconds = time.perf_counter() - began
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-500:]
    return seconds


def sandboxed_seconds(program: str, test: dict, limits: CodeLimits) -> float:
    began = time.perf_counter()
    result = run_test(program, test, limits)
    seconds = time.perf_counter() - began
    assert result.status == "passed", result
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/sandbox_overhead.json")
    parser.add_argument("--rounds", type=int, default=5, help="rounds after the warm-up round")
    parser.add_argument("--runs", type=int, default=10, help="runs of each kind per round")
    parser.add_argument("--tests", type=int, default=60, help="tests per throughput measurement")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "sandbox_overhead.json"
    reason = isolation.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no sandbox here to measure: {reason}")
    limits = CodeLimits(kill_after_s=30.0)  # no run of a busy machine killed: this measures cost, not limits
    before = snapshot()
    time.sleep(3)
    load = others_cores(before, snapshot())
    kinds = {"bare_empty": lambda: bare_seconds(EMPTY),
             "sandbox_empty": lambda: sandboxed_seconds(EMPTY, STDIN_TEST, limits),
             "sandbox_call": lambda: sandboxed_seconds(CALL_PROGRAM, CALL_TEST, limits)}
    rounds = []
    for index in range(args.rounds + 1):
        row = {"round": index, **{kind: [run() for _ in range(args.runs)] for kind, run in kinds.items()}}
        rounds.append(row)
        medians = {kind: round(statistics.median(row[kind]) * 1000, 1) for kind in kinds}
        print(json.dumps({"round": index, "median_ms": medians}), flush=True)
    measured = rounds[1:]
    median_ms = {kind: statistics.median(v for r in measured for v in r[kind]) * 1000 for kind in kinds}
    throughput = {}
    for workers in sorted({1, args.workers}):
        for name, program, test in (("empty_stdin", EMPTY, STDIN_TEST), ("call", CALL_PROGRAM, CALL_TEST)):
            began = time.perf_counter()
            results = run_tests(program, [test] * args.tests, limits, workers=workers)
            seconds = time.perf_counter() - began
            assert all(r.passed for r in results)
            throughput[f"{name}_workers_{workers}"] = args.tests / seconds
            print(json.dumps({"throughput": f"{name}_workers_{workers}",
                              "tests_per_s": round(args.tests / seconds, 2)}), flush=True)
    bwrap = subprocess.run([isolation.bwrap_path() or "bwrap", "--version"], capture_output=True,
                           text=True).stdout.strip()
    report = {"what": "code sandbox: ms per test run (bubblewrap + limits) vs a bare subprocess; tests per second",
              "bwrap": bwrap, "as_root": os.geteuid() == 0, "cpus": os.cpu_count(), "python": platform.python_version(),
              "rounds": args.rounds, "runs_per_round": args.runs, "tests": args.tests, "workers": args.workers,
              "median_ms": median_ms, "sandbox_overhead_ms": median_ms["sandbox_empty"] - median_ms["bare_empty"],
              "tests_per_second": throughput, "others_cores_before": load, "rounds_measured_s": measured}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = ["| measure | value |", "|---|---|"]
    table += [f"| {kind}, median per test run | {ms:.1f} ms |" for kind, ms in median_ms.items()]
    table += [f"| sandbox overhead (empty program) | {report['sandbox_overhead_ms']:.1f} ms |"]
    table += [f"| {name} | {rate:.1f} tests/s |" for name, rate in throughput.items()]
    table += [f"| other processes' cores before | {load:.2f} |"]
    print("\n".join(table), f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
