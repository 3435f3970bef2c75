"""The trainer at longer completions on one GPU: step phases and peak memory of the sampled-token
loss, the full-vocabulary jsd and jsd with gradient checkpointing, with gpu_check's model and timing.

    python -m experiments.benchmarks.gpu_check --prepare                                 # once, here
    PYTHONPATH=. python3 -m experiments.benchmarks.gpu_scale_probe --out $OUT/gpu_scale_probe.json
    PYTHONPATH=. python3 -m experiments.benchmarks.gpu_scale_probe --tiny --out /tmp/probe.json  # CPU

16 prompts x 4 samples x 512 tokens, 3 steps a case (the first a warm-up); it starts no case after
240 s and writes its JSON after every case. Its H200 run is experiments/benchmarks/results/
gpu_scale_probe.json (about 5.5 minutes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from experiments.benchmarks import gpu_check

CASES = (gpu_check.Case("full", ()), gpu_check.Case("full+jsd", ("loss.divergence=jsd",)),
         gpu_check.Case("full+ckpt+jsd", ("model.gradient_checkpointing=true", "loss.divergence=jsd")))
SHAPE = {"prompts": 16, "samples": 4, "max_tokens": 512, "micro_batch_prompts": 4}
TINY_SHAPE = {"prompts": 2, "samples": 2, "max_tokens": 16, "micro_batch_prompts": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="gpu_check's tiny model on the CPU")
    parser.add_argument("--tokenizer-dir", type=Path, default=gpu_check.TOKENIZER_DIR,
                        help="tokenizer files (default: what gpu_check --prepare wrote)")
    args = parser.parse_args(argv)
    device, shape, budget = ("cpu", TINY_SHAPE, 100) if args.tiny else ("cuda", SHAPE, 240)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp())
    architecture = dict(gpu_check.TINY) if args.tiny else json.loads(gpu_check.MODEL_CONFIG.read_text())
    report = {"shape": shape, "cases": {}, "model": gpu_check.write_random_model(
        work / "model", args.tokenizer_dir, architecture, device, torch.bfloat16)}
    for case in CASES:
        if time.monotonic() - start > budget:
            report["cases"][case.name] = "skipped: budget"
            continue
        result = gpu_check.time_case(case, work / "model", work, device, "bfloat16", shape, 3, start + budget + 100)
        report["cases"][case.name] = result
        args.out.write_text(json.dumps(report, indent=1))
        phases = result.get("phase_s_median", {})
        print(case.name, result.get("error") or f"step {result['step_s_median']:.2f} s, train "
              f"{phases['time/train']:.3f} s, sample {phases['time/sample']:.2f} s, peak {result.get('peak_memory_gib')} GiB",
              flush=True)
    report["wall_s"] = time.monotonic() - start
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
