"""The in-process sampler's four paths side by side: eager, MKL-packed, compiled, compiled and packed.

    python -m experiments.benchmarks.sampling_paths --out experiments/benchmarks/results/sampling_paths.json

The work is `vs_trl.py`'s same work (its `full` config: the packaged SmolLM2-135M-Instruct in fp32,
8 prompts x 1 sample of at most 64 tokens at temperature 1, `engine.batch_size` 8): the sampling
request of training steps 0-3, rendered as the run renders them. In one process (what other
processes take of the machine, they take from every path): each path samples step 0 once (the
compiled paths compile there; that call's seconds are reported as the compile call), then `--reps`
rounds in which every path samples the same step (round r: step r mod 4), the paths in turn.
Reported: per path the median seconds of a call, each call against its floor (`vs_trl.phase_floors`'s
sampling formula: every fp32 weight read once per decode step at the bandwidth measured in the same
run, plus the prompts' prefill at the measured matmul rate), the ratio to the eager call of the same
round, and whether every path drew the same tokens as the eager one (the same policy, the same
seed: they must, up to fp32 summation order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = {"eager": (False, False), "packed": (True, False), "compiled": (False, True), "compiled+packed": (True, True)}
STEPS = 4  # distinct sampling requests the rounds cycle through


def child(reps: int, out: Path) -> None:
    """Every path's calls, as JSON into `out`."""
    from experiments.benchmarks.vs_trl import selfopd_config
    from selfopd.training.rollout_pipeline import request_for_step, sample_request
    from selfopd.training.setup import build_run

    with tempfile.TemporaryDirectory(prefix="sampling_paths-") as scratch:
        run = build_run(selfopd_config("full", Path(scratch), "sampling_paths"))
        engine = run.student_engine
        requests = [request_for_step(run.student_side, step) for step in range(STEPS)]
        calls: dict[str, list[dict]] = {path: [] for path in PATHS}
        try:
            for rep in range(reps + 1):  # rep 0: every path's first call (the compiled paths compile in it)
                step = rep % STEPS
                for path, (packed, compiled) in PATHS.items():
                    engine.packed, engine.compiled = packed, compiled
                    start = time.perf_counter()
                    sampled = sample_request(engine, requests[step], step)
                    seconds = time.perf_counter() - start
                    rollouts = [r for group in sampled.groups for r in group]
                    calls[path].append({
                        "rep": rep, "step": step, "seconds": seconds,
                        "decode_steps": max(len(r.completion_ids) for r in rollouts),
                        "prompt_tokens": sum(len(r.prompt_ids) for r in rollouts),
                        "generated_tokens": sum(len(r.completion_ids) for r in rollouts),
                        "completions": [r.completion_ids for r in rollouts]})
                    print(f"rep {rep} step {step} {path}: {seconds:.2f} s", flush=True)
        finally:
            run.close()
        parameters = sum(p.numel() for p in run.model.parameters())
    out.write_text(json.dumps({"parameters": parameters, "calls": calls}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=8, help="timed rounds after the first (compiling) one")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "sampling_paths.json")
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        return child(args.reps, args.child_out)
    from experiments.benchmarks.train_phase import child_result, commit_of
    from experiments.benchmarks.vs_trl import machine_limits, phase_floors

    result = child_result("experiments.benchmarks.sampling_paths", args.reps)
    limits = machine_limits()

    def floor(call: dict) -> float:
        return phase_floors([{**call, "step": 2}], result["parameters"], limits)["sampling"]

    eager = {c["rep"]: c for c in result["calls"]["eager"]}
    paths = {}
    for path, calls in result["calls"].items():
        timed = [c for c in calls if c["rep"]]
        paths[path] = {
            "first_call_s": calls[0]["seconds"],
            "median_s": statistics.median(c["seconds"] for c in timed),
            "over_floor": statistics.median(c["seconds"] / floor(c) for c in timed),
            "over_eager": statistics.median(c["seconds"] / eager[c["rep"]]["seconds"] for c in timed),
            "same_draws_as_eager": sum(c["completions"] == eager[c["rep"]]["completions"] for c in calls),
            "calls": [{k: v for k, v in c.items() if k != "completions"} for c in calls]}
        print(f"{path}: {paths[path]['median_s']:.2f} s a call ({paths[path]['over_floor']:.2f}x its floor, "
              f"{paths[path]['over_eager']:.2f}x eager); first call {calls[0]['seconds']:.1f} s; same draws as eager "
              f"in {paths[path]['same_draws_as_eager']} of {len(calls)} calls")
    report = {"what": __doc__.split("\n\n")[0], "commit": commit_of(ROOT), "reps": args.reps, "limits": limits,
              "parameters": result["parameters"], "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "paths": paths}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
