"""Peak memory of in-process sampling against S x B x V: selfopd's engine vs keeping generate's scores.

    python -m experiments.benchmarks.sampling_memory                 # B = 8, V = 49152, S = 128, 512, 1024
    python -m experiments.benchmarks.sampling_memory --quick         # S = 32, 128
    python -m experiments.benchmarks.sampling_memory --out experiments/benchmarks/results/sampling_memory.json

The sampler must report the logprob of each drawn token under the distribution it was drawn
from. Keeping `generate`'s per-step logits for that (`output_logits=True`, then stack and
log-softmax: what the engine did before, with its scores) holds S x (B, V) fp32 logits
several times over, 80 GB at 64 x 2048 tokens and a 152k vocabulary.
`selfopd.engines.local.SampledPolicy` keeps each step's (B,) logprobs only. Both draw with
that policy, so they sample the same tokens (checked here).

The model is a random 2-layer Llama with SmolLM2's 49152-token vocabulary and a small hidden
size, so that the logits dominate; it never stops early (no end-of-sequence id), so every
row has exactly S new tokens. Each (S, method) runs in a fresh subprocess, which reports its
peak RSS (getrusage ru_maxrss) minus its RSS just before sampling, with glibc told to map
every allocation over 64 KiB on its own (freed memory leaves RSS). Writes a JSON file (to
runs/benchmarks/ unless --out says otherwise) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("selfopd", "scores_kept")


def build(vocabulary: int):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from selfopd.core.models import resolve_model

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config = LlamaConfig(vocab_size=vocabulary, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=None, pad_token_id=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every row runs to S tokens
    return model, tokenizer


def sample(method: str, model, tokenizer, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """(B, S) new token ids; the logprobs are computed and dropped, as a step would use them."""
    from selfopd.engines.base import SamplingParams
    from selfopd.engines.local import LocalEngine, left_pad

    if method == "selfopd":
        engine = LocalEngine(model, tokenizer, batch_size=len(prompts))
        groups = engine.sample(prompts, SamplingParams(max_tokens=steps, temperature=1.0, seed=0))
        return torch.tensor([group[0].completion_ids for group in groups])
    from selfopd.engines.local import SampledPolicy

    ids_BT, mask_BT = left_pad(prompts, 2)
    torch.manual_seed(0)
    with torch.no_grad():  # the same draws, with generate keeping every step's scores
        output = model.generate(input_ids=ids_BT, attention_mask=mask_BT, max_new_tokens=steps, pad_token_id=2,
                                do_sample=False, logits_processor=[SampledPolicy(1.0, 1.0)], output_logits=True,
                                return_dict_in_generate=True)
    new_BS = output.sequences[:, ids_BT.shape[1]:]
    drawn_BSV = torch.stack(output.logits, dim=1).float().log_softmax(-1)
    drawn_BSV.gather(-1, new_BS.unsqueeze(-1))
    return new_BS


def current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = build(args.vocab)
    prompts = [[1, 30 + row, 40 + row, 50] for row in range(args.batch)]
    sample(args.method, model, tokenizer, prompts, 4)  # warm-up: lazy imports, thread pools
    baseline_mb = current_rss_mb()
    tokens = sample(args.method, model, tokenizer, prompts, args.steps)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak_mb - baseline_mb, "tokens": tokens.tolist()}))


def measure(args: argparse.Namespace, steps: int, method: str) -> dict:
    command = [sys.executable, __file__, "--child", "--method", method, "--steps", str(steps),
               "--batch", str(args.batch), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", default="128,512,1024", help="comma-separated numbers of new tokens S")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="S = 32, 128")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "benchmarks" / "sampling_memory.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.steps = int(args.steps)
        return child(args)
    steps_list = [32, 128] if args.quick else [int(s) for s in args.steps.split(",")]
    rows = []
    print(f"B = {args.batch}, V = {args.vocab}; peak RSS growth while sampling, MB")
    print(f"{'S':>6} {'S*B*V*4 MB':>11} {'selfopd':>9} {'scores kept':>12} {'selfopd/SBV':>12} {'kept/SBV':>9} same tokens")
    for steps in steps_list:
        logits_mb = steps * args.batch * args.vocab * 4 / 2**20
        result = {method: measure(args, steps, method) for method in METHODS}
        if any("error" in r for r in result.values()):
            print(f"{steps:>6} failed: {result}")
            rows.append({"steps": steps, **result})
            continue
        same = result["selfopd"]["tokens"] == result["scores_kept"]["tokens"]
        row = {"steps": steps, "batch": args.batch, "vocab": args.vocab, "logits_mb": logits_mb,
               "selfopd_peak_mb": result["selfopd"]["peak_mb"], "scores_kept_peak_mb": result["scores_kept"]["peak_mb"],
               "selfopd_over_logits": result["selfopd"]["peak_mb"] / logits_mb,
               "scores_kept_over_logits": result["scores_kept"]["peak_mb"] / logits_mb, "same_tokens": same}
        rows.append(row)
        print(f"{steps:>6} {logits_mb:>11.0f} {row['selfopd_peak_mb']:>9.1f} {row['scores_kept_peak_mb']:>12.1f} "
              f"{row['selfopd_over_logits']:>12.3f} {row['scores_kept_over_logits']:>9.2f} {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"what": "peak RSS growth (MB) while sampling B rows of S new tokens, in process, on the CPU",
               "torch": torch.__version__, "threads": args.threads, "rows": rows}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
