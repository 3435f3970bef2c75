"""The training phase of one fixed batch, timed and profiled, the loss kernels' two paths side by side.

    python -m experiments.benchmarks.train_phase --out experiments/benchmarks/results/train_phase.json

The batch is `vs_trl.py`'s same work (its `full` config: the packaged SmolLM2-135M-Instruct in
fp32, 8 prompts x 1 sample of at most 64 tokens, a frozen teacher of the same weights after the
student's own prompt, the full-vocabulary reverse KL), sampled once from the run's seed; the
student's final norm is then scaled by 1.1, so that the loss and its gradient are not exactly 0.
In one process (what other processes take of the machine, they take from both paths): one
warm-up, then `--reps` repetitions of the teacher's scoring (`step.score`) and of the student's
forward, heads and backward (`step.forward_backward`, gradients zeroed after each), alternating
three paths: `recompute` (every loss window formed again in backward, as before the kernels kept
the last window's gradient), `new` (the kernels as they are) and `compiled` (`new` with the student's
decoder layers compiled, model.compile_layers; its warm-up call compiles); then one more of each under
torch.profiler (record_shapes) for the top operators by self time. Reported: per path the median
seconds of each phase, its ratio to the phase's FLOP floor on this machine (`vs_trl.phase_floors`'s
formulas, the limits measured in the same run) and to the batch's matrix products alone at their
shapes, the loss and the gradient's norm (the same on both paths), and the profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
TOP = 15  # operators kept per profile


def child(reps: int, out: Path) -> None:
    """The timings and profiles of the fixed batch on both paths, as JSON into `out`."""
    import torch

    from experiments.benchmarks.vs_trl import selfopd_config
    from selfopd.run.tracking import PhaseTimer
    from selfopd.training.setup import build_run
    from selfopd.training.step import forward_backward, score

    with tempfile.TemporaryDirectory(prefix="train_phase-") as scratch:
        run = build_run(selfopd_config("full", Path(scratch), "train_phase"))
        try:
            sampled = run.rollouts.take(run.student_side, run.step, PhaseTimer())
            rollouts = [r for group in sampled.groups for r in group]
            with torch.no_grad():  # the student a little off its frozen teacher: a loss and a gradient that are not 0
                run.model.get_decoder().norm.weight.mul_(1.1)

            def phases() -> tuple[float, float, float, float]:
                timer = PhaseTimer()
                scored, states = score(run, sampled, timer)
                backward = forward_backward(run, scored, states, timer)
                grads = [p.grad for p in run.model.parameters() if p.grad is not None]
                norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item()
                run.optimizer.zero_grad(set_to_none=True)
                return timer.seconds["teacher"], timer.seconds["train"], backward.loss_total, norm

            paths = ("recompute", "new", "compiled")
            runs: dict[str, list] = {path: [] for path in paths}
            for rep in range(reps + 1):  # the paths alternate: what other processes take, they take from both
                for path in paths:
                    with path_code(path, run.model):
                        timed = phases()
                    if rep:
                        runs[path].append(timed)
            profiles = {}
            for path in paths:
                with path_code(path, run.model):
                    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                    timer = PhaseTimer()
                    with profile:
                        scored, states = score(run, sampled, timer)
                    profiles[f"{path}/teacher"] = top_operators(profile, timer.seconds["teacher"])
                    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                    with profile:
                        forward_backward(run, scored, states, timer)
                    run.optimizer.zero_grad(set_to_none=True)
                    profiles[f"{path}/train"] = top_operators(profile, timer.seconds["train"])
            rows = len(rollouts) * (max(len(r.prompt_ids) for r in rollouts) + max(len(r.completion_ids) for r in rollouts))
            real = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
            matmuls = matmul_seconds(run.model, rows, real, sum(len(r.completion_ids) for r in rollouts))
            student_scoring = student_scoring_seconds(run, rollouts)
        finally:
            run.close()
    ids = json.dumps([[r.prompt_ids, r.completion_ids] for r in rollouts]).encode()
    out.write_text(json.dumps({
        "batch": hashlib.sha256(ids).hexdigest()[:16],
        "prompt_tokens": sum(len(r.prompt_ids) for r in rollouts),
        "completion_tokens": sum(len(r.completion_ids) for r in rollouts),
        "padded_prompt": max(len(r.prompt_ids) for r in rollouts) * len(rollouts),
        "padded_completion": max(len(r.completion_ids) for r in rollouts) * len(rollouts),
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "paths": {path: {"teacher_s": [r[0] for r in timed], "train_s": [r[1] for r in timed], "loss": timed[0][2],
                         "grad_norm": timed[0][3]} for path, timed in runs.items()},
        "matmul_s": matmuls, "student_scoring_s": student_scoring, "profiles": profiles}))


@contextlib.contextmanager
def path_code(path: str, model: Any) -> Iterator[None]:
    """The code a path runs: `recompute` and `new` (`loss_windows`), or `compiled`: `new` with the
    student's decoder layers compiled (model.compile_layers), eager again after the block."""
    if path != "compiled":
        with loss_windows(path):
            yield
        return
    from selfopd.engines.compiled import compile_decoder_layers

    compile_decoder_layers(model)
    try:
        yield
    finally:
        for module in model.modules():
            module.__dict__.pop("forward", None)


@contextlib.contextmanager
def loss_windows(path: str) -> Iterator[None]:
    """`new`: the kernels as they are; `recompute`: every loss window formed again in backward
    (`keep_last=False`), the kernels' arithmetic before they kept the last window's gradient."""
    from selfopd.engines import kernels
    from selfopd.training import divergences

    original = kernels.chunked_on_real_positions
    if path == "recompute":
        def recomputing(hidden: Any, weight: Any, mask: Any, function: Any, chunk: int, keep_last: bool = True) -> Any:
            return original(hidden, weight, mask, function, chunk, False)

        kernels.chunked_on_real_positions = divergences.chunked_on_real_positions = recomputing
    try:
        yield
    finally:
        kernels.chunked_on_real_positions = divergences.chunked_on_real_positions = original


def student_scoring_seconds(run: Any, rollouts: list[Any]) -> float:
    """Best of 3: the student's sampled-token logprobs from its final hidden states, without gradient,
    as a full-vocabulary loss reads them (a head and a log-softmax over the completion positions that
    the divergence's own window forms again)."""
    import torch

    from selfopd.engines.scoring import completion_hidden, logprobs_from_hidden

    with torch.no_grad():
        hidden_BCH, tokens_BC, mask_BC = completion_hidden(run.model, [(r.prompt_ids, r.completion_ids) for r in rollouts],
                                                           run.pad_id)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            logprobs_from_hidden(run.model, hidden_BCH, tokens_BC, mask_BC)
            times.append(time.perf_counter() - start)
    return min(times)


def matmul_seconds(model: Any, rows: int, real: int, completion: int) -> dict[str, float]:
    """Seconds of the batch's matrix products alone, each at its shape (best of 3; fp32, this
    process's threads): every linear layer of the decoder over the padded `rows` (one pass over
    left-padded prompt and right-padded completion), forward (x W^T) and backward (its input's and
    its weight's gradient), and the output head over the `completion` positions; and the decoder's
    forward over the `real` (unpadded) tokens, what padding costs."""
    import torch

    def best(m: int, k: int, n: int) -> float:
        a, b = torch.randn(m, k), torch.randn(k, n)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    shapes = Counter((m.in_features, m.out_features) for m in model.get_decoder().modules()
                     if isinstance(m, torch.nn.Linear))
    vocabulary, hidden = model.get_output_embeddings().weight.shape
    return {"decoder_forward": sum(c * best(rows, i, o) for (i, o), c in shapes.items()),
            "decoder_backward": sum(c * (best(rows, o, i) + best(o, rows, i)) for (i, o), c in shapes.items()),
            "head_forward": best(completion, hidden, vocabulary),
            "head_backward": best(completion, vocabulary, hidden) + best(vocabulary, completion, hidden),
            "unpadded_decoder_forward": sum(c * best(real, i, o) for (i, o), c in shapes.items())}


def top_operators(prof: Any, phase_seconds: float) -> dict[str, Any]:
    """The profiled phase's seconds and its `TOP` operators by self CPU time: by name, and by name
    and input shapes."""
    def rows(by_shape: bool) -> list[dict[str, Any]]:
        events = sorted(prof.key_averages(group_by_input_shape=by_shape), key=lambda e: e.self_cpu_time_total,
                        reverse=True)
        return [{"op": e.key, **({"shapes": str(e.input_shapes)[:160]} if by_shape else {}), "calls": e.count,
                 "self_s": round(e.self_cpu_time_total / 1e6, 4)} for e in events[:TOP]]

    return {"phase_s": phase_seconds, "top": rows(False), "top_by_shape": rows(True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each path, after one warm-up")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "train_phase.json")
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        return child(args.reps, args.child_out)
    from experiments.benchmarks.vs_trl import machine_limits

    result = child_result("experiments.benchmarks.train_phase", args.reps)
    limits = machine_limits()
    flops = limits["matmul_gflop_s"] * 1e9
    tokens = result["prompt_tokens"] + result["completion_tokens"]
    matmuls = result["matmul_s"]
    floors = {"teacher": 2 * result["parameters"] * tokens / flops, "train": 6 * result["parameters"] * tokens / flops,
              "train_matmuls": sum(matmuls[k] for k in ("decoder_forward", "decoder_backward", "head_forward", "head_backward")),
              "teacher_matmuls": matmuls["decoder_forward"] + matmuls["head_forward"]}
    report = {**result, "commit": commit_of(ROOT), "reps": args.reps, "limits": limits, "floors_s": floors,
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for path, timed in result["paths"].items():
        for phase in ("teacher", "train"):
            median = statistics.median(timed[f"{phase}_s"])
            timed[f"{phase}_median_s"] = median
            timed[f"{phase}_over_floor"] = median / floors[phase]
            timed[f"{phase}_over_matmuls"] = median / floors[f"{phase}_matmuls"]
        print(f"{path}: teacher {timed['teacher_median_s']:.3f} s ({timed['teacher_over_floor']:.2f}x floor), train "
              f"{timed['train_median_s']:.3f} s ({timed['train_over_floor']:.2f}x floor, {timed['train_over_matmuls']:.2f}x "
              f"its matmuls), loss {timed['loss']!r}, grad norm {timed['grad_norm']!r}")
    for path, base in (("new", "recompute"), ("compiled", "new")):
        paired = [a / b for a, b in zip(result["paths"][path]["train_s"], result["paths"][base]["train_s"])]
        report[f"train_{path}_over_{base}"] = {"per_rep": paired, "median": statistics.median(paired)}
        print(f"train phase, {path} / {base} per repetition: median {statistics.median(paired):.3f} "
              f"({', '.join(f'{r:.3f}' for r in paired)})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


def child_result(module: str, reps: int) -> dict[str, Any]:
    """What `python -m module --reps R --child-out FILE` wrote: the measurement runs in a process of its
    own (the machine's limits are then measured alone), offline, compiling from an empty inductor cache."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TORCHINDUCTOR_CACHE_DIR": cache}
        subprocess.run([sys.executable, "-m", module, "--reps", str(reps), "--child-out", out.name], env=env,
                       check=True, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


def commit_of(code: Path) -> str:
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--", "selfopd"], capture_output=True, text=True)
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
