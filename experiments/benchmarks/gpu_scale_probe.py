"""The scale mode of the prepared GPU check: the trainer at 16 prompts x 4 samples x 512 tokens on the
Qwen3-1.7B shape, per phase against the bf16 matmul peak measured in the same run.

    python -m experiments.benchmarks.gpu_check --prepare                   # once, here: tokenizer files
    bash experiments/benchmarks/gpu_check.sh scale --out $OUT/gpu_scale_probe.json   # one GPU, < 8 minutes
    PYTHONPATH=. python3 -m experiments.benchmarks.gpu_scale_probe --tiny --out /tmp/probe.json  # CPU dry run

Cases: the sampled-token loss, the same sampled with a static KV cache and a compiled decode step
(`engine.compiled_sampling`, CUDA graphs), the same with the decoder layers compiled
(`model.compile_layers`; a compiled case's first step compiles), the full-vocabulary jsd,
jsd + gradient checkpointing, LoRA (rank 64),
with gpu_check's random model (`write_random_model`) and timing (`time_case`, the real `build_run` +
`train_step`). Per case and phase (the step metrics' `time/*`): the median time over the steps after
the first, the tokens that phase handled and tokens/s; for the train phase and the teacher's forward
also FLOP/s and its fraction of the peak of a large bf16 matmul timed at the start (best of a few
reps); for sampling the seconds a decode step (over the longest completion's tokens: the 64 rows are
one batch of engine.batch_size); peak memory (CUDA only, null on the CPU). Tokens per phase: train,
the student's prompt + completion tokens; teacher, the teacher's prompt + completion tokens; every
other phase (sample, verify, optim, step, ...), the step's completion tokens.

FLOPs counted (model FLOPs, as in 6·N·T): N = the non-embedding parameters (every parameter but the
input embedding and the output head, tied or not) over T = every rollout's prompt + completion tokens,
unpadded, a prompt counted once per sample (as the issue's before-figures did; the trainer computes a
prompt its samples share once, except under checkpointing: `tokens.distinct_prompt` is the count with
each prompt once, a few % of T at 512 tokens); plus the head's V·H per completion token (the only
positions whose logits are computed). Train: 6 FLOPs a parameter a token (forward + backward), 4 with
LoRA (the frozen weights need no weight gradient; the adapters' own FLOPs are not counted). Teacher: 2
(a forward) over the teacher's prompt + completion. Not counted: attention's score and value matmuls,
checkpointing's recompute, the loss's extra head matmuls (jsd's teacher head).

Budget: every case gets at least 2 steps (a warm-up and one timed), a third only while the cases after
it keep their 2 (by the longest step seen so far); a case is skipped when 2 such steps no longer fit.
On a GPU it aims to end within 450 s of its start (gpu_check.sh's `scale` stops it at 8 minutes); the
JSON is written after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from experiments.benchmarks import gpu_check
from experiments.benchmarks.gpu_check import Case

# The compiled cases run on a GPU only: on the CPU dry run their compiles would take most of its budget
# (the settings themselves are CPU-tested in tests/engines/test_compiled.py and test_local.py).
CASES = (Case("sampled-token", ()), Case("compiled-sampling", ("engine.compiled_sampling=true",), ("cuda",)),
         Case("compiled-layers", ("model.compile_layers=true",), ("cuda",)),
         Case("jsd", ("loss.divergence=jsd",)),
         Case("jsd+checkpointing", ("loss.divergence=jsd", "model.gradient_checkpointing=true")),
         Case("lora", ("model.lora_rank=64",), ("peft",)))
SHAPE = {"prompts": 16, "samples": 4, "max_tokens": 512, "micro_batch_prompts": 4}
TINY_SHAPE = {"prompts": 2, "samples": 2, "max_tokens": 16, "micro_batch_prompts": 1}
STEPS = 3
# (seconds the run may take, the first guess of a step's seconds, the matmul's size) per mode.
LIMITS = {"cuda": (450.0, 60.0, 8192), "cpu": (120.0, 5.0, 512)}


def matmul_peak(device: str, size: int, reps: int = 5, inner: int = 4) -> dict[str, Any]:
    """The bf16 FLOP/s of a size x size x size matmul on `device`: best of `reps`, each `inner` matmuls."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)  # warm-up: kernel choice, clocks
    gpu_check._synchronize(device)
    best = float("inf")
    for _ in range(reps):
        tick = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=c)
        gpu_check._synchronize(device)
        best = min(best, (time.perf_counter() - tick) / inner)
    return {"size": size, "dtype": "bfloat16", "reps": reps, "matmuls_per_rep": inner, "best_s": best,
            "flop_per_s": 2 * size**3 / best}


def token_counts(scored: list[Any]) -> dict[str, int]:
    """One step's tokens, from the rollouts the teacher scored."""
    completions = [len(s.rollout.completion_ids) for s in scored]
    return {"completion": sum(completions), "longest_completion": max(completions, default=0),
            "prompt": sum(len(s.rollout.prompt_ids) for s in scored),
            "distinct_prompt": sum(len(p) for p in {tuple(s.rollout.prompt_ids) for s in scored}),
            "teacher_prompt": sum(len(s.teacher_prompt) for s in scored)}


@contextlib.contextmanager
def counting_tokens(steps: list[dict[str, int]]) -> Iterator[None]:
    """Append each train_step's token counts to `steps` (the step's own `score`, wrapped)."""
    from selfopd.training import step as step_module

    original = step_module.score

    def score(run: Any, *phase_inputs: Any) -> Any:  # the phase's own arguments, passed on as they are
        scored, states = original(run, *phase_inputs)
        steps.append(token_counts(scored))
        return scored, states

    step_module.score = score
    try:
        yield
    finally:
        step_module.score = original


def phases(result: dict[str, Any], steps: list[dict[str, int]], model: dict[str, Any], peak: float) -> dict[str, Any]:
    """Per phase: median seconds, the tokens it handled (medians over the same steps), tokens/s, and
    for train and teacher FLOPs, FLOP/s and their fraction of `peak`."""
    timed = steps[1:] or steps
    tokens = {key: statistics.median(step[key] for step in timed) for key in timed[0]}
    trained = tokens["prompt"] + tokens["completion"]
    scored = tokens["teacher_prompt"] + tokens["completion"]
    lora = result["trainer"]["trainable_params"] < result["trainer"]["total_params"]
    body, head, completion = model["non_embedding_params"], model["head_params"], tokens["completion"]
    flops = {"train": (4 if lora else 6) * (body * trained + head * completion),
             "teacher": 2 * (body * scored + head * completion)}
    table: dict[str, Any] = {"tokens": tokens}
    for key, seconds in result["phase_s_median"].items():
        name = key.removeprefix("time/")
        count = {"train": trained, "teacher": scored}.get(name, completion)
        entry = {"s": seconds, "tokens": count, "tokens_per_s": count / seconds if seconds > 0 else None}
        if name in flops and seconds > 0:
            entry.update(flop=flops[name], flop_per_s=flops[name] / seconds,
                         fraction_of_matmul_peak=flops[name] / seconds / peak)
            if entry["fraction_of_matmul_peak"] > 1:
                entry["note"] = "above the measured matmul peak: the peak matmul ran below what this device does"
        if name == "sample" and tokens["longest_completion"]:
            entry["s_per_decode_step"] = seconds / tokens["longest_completion"]
        table[name] = entry
    return table


def model_facts(facts: dict[str, Any], architecture: dict[str, Any]) -> dict[str, Any]:
    """`write_random_model`'s facts with the parameter counts the FLOPs use."""
    head = facts["vocab_size"] * architecture["hidden_size"]
    embeddings = head * (1 if architecture.get("tie_word_embeddings") else 2)
    return {**facts, "non_embedding_params": facts["params"] - embeddings, "head_params": head}


def run_case(case: Case, model_dir: Path, work: Path, device: str, shape: dict[str, int], deadline: float,
             model: dict[str, Any], peak: float) -> dict[str, Any]:
    """gpu_check's `time_case` with this probe's per-phase table and peak memory."""
    steps: list[dict[str, int]] = []
    with counting_tokens(steps):
        result = gpu_check.time_case(case, model_dir, work, device, "bfloat16", shape, STEPS, deadline)
    if "error" not in result:
        result["phases"] = phases(result, steps, model, peak)
    result.setdefault("peak_memory_gib", None)  # CUDA only
    return result


def probe(out: Path, tiny: bool, tokenizer_dir: Path, work: Path) -> dict[str, Any]:
    """The model, the matmul peak, then every case that fits the budget; `out` written after each."""
    gpu_check.require_tokenizer(tokenizer_dir)
    start = time.monotonic()
    device, shape = ("cpu", TINY_SHAPE) if tiny else ("cuda", SHAPE)
    limit, step_guess, size = LIMITS[device]
    architecture = dict(gpu_check.TINY) if tiny else json.loads(gpu_check.MODEL_CONFIG.read_text())
    model = model_facts(gpu_check.write_random_model(work / "model", tokenizer_dir, architecture, device,
                                                     torch.bfloat16), architecture)
    peak = matmul_peak(device, size)
    report: dict[str, Any] = {"machine": gpu_check.machine_info(device), "shape": shape, "steps_per_case": STEPS,
                              "limit_s": limit, "model": model, "matmul_peak": peak, "cases": {}}
    for index, case in enumerate(CASES):
        left = limit - (time.monotonic() - start)
        if gpu_check.unmet(case, device):
            report["cases"][case.name] = {"skipped": gpu_check.unmet(case, device)}
        elif left < 2 * step_guess:
            report["cases"][case.name] = {"skipped": f"time budget: {left:.0f} s left, 2 steps take about "
                                                     f"{2 * step_guess:.0f} s"}
        else:  # a third step only while every case after this one keeps its 2 steps
            deadline = start + limit - (2 * (len(CASES) - index - 1) + 1) * step_guess
            result = run_case(case, work / "model", work, device, shape, deadline, model, peak["flop_per_s"])
            report["cases"][case.name] = result
            step_guess = max(step_guess, result.get("first_step_s", 0.0), result.get("step_s_median", 0.0))
        report["wall_s"] = time.monotonic() - start
        out.write_text(json.dumps(report, indent=1))
        print_case(case.name, report["cases"][case.name])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="gpu_check's tiny model on the CPU")
    parser.add_argument("--tokenizer-dir", type=Path, default=gpu_check.TOKENIZER_DIR,
                        help="tokenizer files (default: what gpu_check --prepare wrote)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_scale_probe-") as scratch:  # gigabytes of random weights
        probe(args.out, args.tiny, args.tokenizer_dir, Path(scratch))
    return 0


def print_case(name: str, result: dict[str, Any]) -> None:
    if "phases" not in result:
        print(name, result.get("error") or f"skipped: {result.get('skipped')}", flush=True)
        return
    parts = [f"{phase} {entry['s']:.3f} s" + (f" ({entry['fraction_of_matmul_peak']:.1%} of the matmul peak)"
                                              if "fraction_of_matmul_peak" in entry else "")
             for phase, entry in result["phases"].items() if phase in ("sample", "teacher", "train")]
    print(f"{name}: step {result['step_s_median']:.2f} s; {'; '.join(parts)}; peak {result['peak_memory_gib']} GiB",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
