"""Prepared GPU check: NCCL weight sync into a student and a teacher vLLM server, and throughput.

    bash experiments/gpu_check.sh                     # packaged SmolLM2, fp32, about 5 minutes
    bash experiments/gpu_check.sh --model Qwen/Qwen3-0.6B --dtype bfloat16 --tolerance 2e-2

Needs one CUDA GPU, vLLM for GPUs (`pip install vllm`) and selfopd (`pip install -e .`).
Never run by CI. What it does, in order:

1. launches the student (no prefix cache) and teacher (prefix cache) servers with the
   NCCL weight-transfer backend, each on a share of the GPU;
2. loads the same weights in the trainer process on the GPU and opens one NCCL group
   per server (`NCCLWeightSync`);
3. three rounds: perturb the trainer's weights, push them to both servers (packed NCCL
   broadcast, pause / reset prefix cache / resume, version = round), then check that
   both servers' prompt logprobs on a fixed sequence equal the trainer's within the
   tolerance and that the version arrived;
4. rollout and scoring throughput through `VLLMEngine`.

Prints a table and writes JSON (to $OUT when set, else runs/benchmarks/).
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from selfopd.engines.base import SamplingParams
from selfopd.engines.vllm import VLLMEngine
from selfopd.engines.vllm_server import ServerSpec, free_port, launch_servers
from selfopd.engines.weight_sync import NCCLWeightSync, ServerControl
from selfopd.core.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |server - trainer| logprob after a sync")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    common = dict(model=model_dir, dtype=args.dtype, max_model_len=2048, eager=args.eager, weight_transfer="nccl",
                  gpu_memory_utilization=0.35)
    specs = [ServerSpec(name="student", port=free_port(), prefix_caching=False, **common),
             ServerSpec(name="teacher", port=free_port(), prefix_caching=True, **common)]
    out_dir = Path(os.environ.get("OUT") or ROOT / "runs" / "benchmarks")
    report: dict = {"model": args.model, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(0), "checks": {}}
    started = time.perf_counter()
    with launch_servers(specs, out_dir / "gpu_check_logs", timeout_s=420) as servers:
        report["server_start_s"] = time.perf_counter() - started
        urls = [server.spec.url for server in servers]
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        syncs = [NCCLWeightSync([ServerControl(url)], first_port=free_port()) for url in urls]
        engines = [VLLMEngine([url]) for url in urls]
        messages = [{"role": "user", "content": "What is 17 + 25? Think step by step."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        completion = tokenizer.encode("17 + 25 = 42. The answer is 42.", add_special_tokens=False)

        rounds = []
        originals = {name: p.detach().clone() for name, p in model.named_parameters()}
        for version in (1, 2, 3):
            torch.manual_seed(version)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(originals[name] + 2e-3 * originals[name].std() * torch.randn_like(param))
            named = dict(model.named_parameters())
            push_s = []
            for sync in syncs:
                tick = time.perf_counter()
                sync.push(named, version)
                push_s.append(time.perf_counter() - tick)
            expected = trainer_logprobs(model, prompt, completion)
            diffs = [(engine.score([(prompt, completion)])[0].logprobs - expected).abs().max().item() for engine in engines]
            versions = [ServerControl(url).version() for url in urls]
            gigabytes = sum(p.numel() * p.element_size() for p in named.values()) / 1e9
            rounds.append({"version": version, "push_s": push_s, "gb": gigabytes, "max_abs_diff": diffs,
                           "server_versions": versions})
            print(f"sync {version}: {gigabytes:.3f} GB, push {push_s[0]:.2f} s / {push_s[1]:.2f} s, "
                  f"|server - trainer| {diffs[0]:.2e} / {diffs[1]:.2e}, versions {versions}", flush=True)
        report["sync_rounds"] = rounds
        report["checks"]["sync_logprobs_within_tolerance"] = all(max(r["max_abs_diff"]) <= args.tolerance for r in rounds)
        report["checks"]["versions_arrived"] = all(r["server_versions"] == [str(r["version"])] * 2 for r in rounds)
        report["sync_seconds_per_gb_median"] = statistics.median(s / r["gb"] for r in rounds for s in r["push_s"])

        chat = [tokenizer.apply_chat_template([{"role": "user", "content": f"Explain how to add {i} and {3 * i + 7}."}],
                                              add_generation_prompt=True) for i in range(args.prompts)]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in chat]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=args.samples, seed=0)
        engines[0].sample(prompts[:8], params)  # warm-up
        tick = time.perf_counter()
        groups = engines[0].sample(prompts, params)
        sample_s = time.perf_counter() - tick
        rollouts = [r for g in groups for r in g]
        generated = sum(len(r.completion_ids) for r in rollouts)
        tick = time.perf_counter()
        engines[1].score([(r.prompt_ids, r.completion_ids) for r in rollouts])
        score_s = time.perf_counter() - tick
        report["rollout_tokens_per_s"] = generated / sample_s
        report["scoring_tokens_per_s"] = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts) / score_s
        print(f"rollouts: {len(rollouts)} samples, {generated} tokens in {sample_s:.1f} s = "
              f"{report['rollout_tokens_per_s']:.0f} tok/s; scoring {report['scoring_tokens_per_s']:.0f} tok/s")
        for engine in engines:
            engine.close()
        for sync in syncs:
            sync.close()
    report["total_s"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["checks"]), f"total {report['total_s']:.0f} s")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
