"""Prepared vLLM GPU check: the weight push over NCCL into a student and a teacher vLLM server,
every push verified by digest, and throughput.

    bash experiments/gpu_check.sh                      # packaged SmolLM2, fp32, about 5 minutes
    bash experiments/gpu_check.sh --model Qwen/Qwen3-0.6B --dtype bfloat16 --tolerance 2e-2
    python experiments/gpu_check.py --plan --gpus 2    # the layout it would use, checked, on any machine

Needs at least two CUDA GPUs (NCCL refuses the trainer and a server worker on one GPU), vLLM
for GPUs (`pip install -e '.[gpu]'`). Never run by CI. What it does, in order:

1. places itself as a training run would (`selfopd.engines.gpu_layout.check_layout`): the
   trainer on GPU 0, the student server on GPU 1, the teacher on GPU 2 when there is one, else
   beside the student (two NCCL groups then: one GPU may not appear twice in one group);
2. launches both servers with selfopd's weight-transfer engine and opens the push as a run
   does (`selfopd.engines.serving.open_weight_transfers`: the trainer is rank 0);
3. three rounds: perturb the trainer's weights, push them (packed NCCL broadcast, pause /
   reset prefix cache / resume, version = round, digests compared on every worker), then check
   both servers' prompt logprobs on a fixed sequence against the trainer's and their versions;
4. rollout and scoring throughput through `VLLMEngine`.

Prints a table and writes JSON (to $OUT when set, else runs/benchmarks/). Exits non-zero when a
check fails. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from selfopd.config import load_config
from selfopd.engines.base import SamplingParams
from selfopd.engines.gpu_layout import check_layout
from selfopd.engines.server_control import ServerControl
from selfopd.engines.serving import gpu_count, open_vllm_engines
from selfopd.core.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def plan_config(model: str, dtype: str, gpus: int, eager: bool):
    """The training config whose layout the check uses: trainer on GPU 0, servers on the others."""
    teacher_gpu = 2 if gpus > 2 else 1
    return load_config(ROOT / "experiments/demo.toml", [
        "engine.kind=vllm", "engine.weight_sync=nccl", "model.device=cuda:0", f"model.student={model}",
        f"model.dtype={dtype}", "engine.student_gpus=1", f"engine.teacher_gpus={teacher_gpu}",
        "engine.gpu_memory_utilization=0.4", "engine.max_model_len=2048", "rollout.temperature=1",
        f"engine.compile={'off' if eager else 'auto'}", "run.progress=true"])


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |server - trainer| logprob after a push")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--plan", action="store_true", help="print the checked layout and stop")
    parser.add_argument("--gpus", type=int, help="with --plan: the GPUs of the machine to plan for (default: this one's)")
    args = parser.parse_args()
    gpus = args.gpus if args.plan and args.gpus is not None else gpu_count()
    if gpus < 2:
        print(f"gpu_check: needs 2 GPUs or more (this machine: {gpus}): NCCL refuses the trainer and a server "
              "worker on one GPU; `selfopd train --set engine.kind=vllm_colocate` is the one-GPU mode", file=sys.stderr)
        return 2
    config = plan_config(args.model, args.dtype, gpus, args.eager)
    layout = check_layout(config, [0], gpus)  # a ConfigError names the rule broken
    print(layout.table())
    if args.plan:
        return 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(os.environ.get("OUT") or ROOT / "runs" / "benchmarks")
    torch.cuda.set_device(0)
    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report: dict = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(0), "gpus": gpus,
                    "checks": {}}
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        student, teacher = open_vllm_engines(config, out_dir / "gpu_check_logs", stack, progress=True, trainer_gpus=[0])
        report["server_start_s"] = time.perf_counter() - started
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        messages = [{"role": "user", "content": "What is 17 + 25? Think step by step."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        completion = tokenizer.encode("17 + 25 = 42. The answer is 42.", add_special_tokens=False)
        urls = [*student.urls, *teacher.urls]

        rounds = []
        originals = {name: p.detach().clone() for name, p in model.named_parameters()}
        for version in (1, 2, 3):
            torch.manual_seed(version)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(originals[name] + 2e-3 * originals[name].std() * torch.randn_like(param))
            student.update_weights(dict(model.named_parameters()), version)  # the self teacher shares the push
            stats = dict(student.weight_sync.stats)
            expected = trainer_logprobs(model, prompt, completion)
            diffs = [(engine.score([(prompt, completion)])[0].logprobs - expected).abs().max().item()
                     for engine in (student, teacher)]
            versions = [ServerControl(url).version() for url in urls]
            rounds.append({"version": version, **stats, "max_abs_diff": diffs, "server_versions": versions})
            print(f"push {version}: {stats['sync/gigabytes']:.3f} GB in {stats['time/push']:.2f} s "
                  f"({stats['sync/broadcasts']:.0f} broadcasts, {stats['sync/groups']:.0f} groups, verified in "
                  f"{stats['time/push_verify']:.2f} s), |server - trainer| {diffs[0]:.2e} / {diffs[1]:.2e}, "
                  f"versions {versions}", flush=True)
        report["push_rounds"] = rounds
        report["checks"]["every_push_verified_by_digest"] = all(r["time/push_verify"] > 0 for r in rounds)
        report["checks"]["logprobs_within_tolerance"] = all(max(r["max_abs_diff"]) <= args.tolerance for r in rounds)
        report["checks"]["versions_arrived"] = all(set(r["server_versions"]) == {str(r["version"])} for r in rounds)
        report["push_seconds_per_gb_median"] = statistics.median(r["time/push"] / r["sync/gigabytes"] for r in rounds)

        chat = [tokenizer.apply_chat_template([{"role": "user", "content": f"Explain how to add {i} and {3 * i + 7}."}],
                                              add_generation_prompt=True) for i in range(args.prompts)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in chat]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=args.samples, seed=0)
        student.sample(prompts[:8], params)  # warm-up
        tick = time.perf_counter()
        groups = student.sample(prompts, params)
        sample_s = time.perf_counter() - tick
        rollouts = [r for g in groups for r in g]
        generated = sum(len(r.completion_ids) for r in rollouts)
        tick = time.perf_counter()
        teacher.score([(r.prompt_ids, r.completion_ids) for r in rollouts])
        score_s = time.perf_counter() - tick
        report["rollout_tokens_per_s"] = generated / sample_s
        report["scoring_tokens_per_s"] = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts) / score_s
        print(f"rollouts: {len(rollouts)} samples, {generated} tokens in {sample_s:.1f} s = "
              f"{report['rollout_tokens_per_s']:.0f} tok/s; scoring {report['scoring_tokens_per_s']:.0f} tok/s")
    report["total_s"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["checks"]), f"total {report['total_s']:.0f} s")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
