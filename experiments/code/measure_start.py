"""How often the base student passes the procedural code task before any training, per difficulty level:
the share of functions whose shown tests all pass and whose hidden tests all pass, with Wilson 95%
intervals. The issue asks for a level at which the packaged SmolLM2-135M-Instruct passes 10-40% at the
start (enough reward to learn from, room to improve); pick `codegen?level=` from this table.

    python -m experiments.code.measure_start                    # levels 1-3, 64 functions each
    python -m experiments.code.measure_start --levels 1 --items 16

Programs run only through the sandboxed runner (`selfopd.verifiers.code_runner.run_tests`); without it
the script stops before loading a model. Writes JSON to runs/experiments/ (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str) -> str:
    """The longest fenced code block (SDPO's rule), else the whole completion."""
    blocks = FENCE.findall(completion)
    return max(blocks, key=len) if blocks else completion


def wilson(passed: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return (0.0, 1.0)
    p = passed / total
    centre, half = p + z * z / (2 * total), z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return (max(0.0, (centre - half) / (1 + z * z / total)), min(1.0, (centre + half) / (1 + z * z / total)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--levels", nargs="+", default=["1", "2", "3"], help="levels or mixtures (2+3)")
    parser.add_argument("--items", type=int, default=64, help="distinct functions per level")
    parser.add_argument("--seed", type=int, default=0, help="the codegen seed")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "experiments" / "code_start.json")
    args = parser.parse_args()
    try:
        from selfopd.verifiers.code_runner import run_tests
    except ImportError as error:
        sys.exit(f"measure_start: the sandboxed code runner is not there yet ({error}); nothing was run")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfopd.core.models import resolve_model
    from selfopd.data import load_examples

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    results = {"model": args.model, "seed": args.seed, "items": args.items, "max_tokens": args.max_tokens,
               "decoding": "greedy", "levels": {}}
    for level in args.levels:
        examples = load_examples(f"codegen?level={level}&size={args.items}&seed={args.seed}")
        counts = {"shown": 0, "hidden": 0, "both": 0, "shown_tests": 0, "hidden_tests": 0}
        for start in range(0, len(examples), args.batch_size):
            batch = examples[start:start + args.batch_size]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                                   add_generation_prompt=True) for ex in batch]
            encoded = tokenizer(texts, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**encoded, max_new_tokens=args.max_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            for ex, ids in zip(batch, out[:, encoded["input_ids"].shape[1]:]):
                program = extract_program(tokenizer.decode(ids, skip_special_tokens=True))
                code = ex.meta["code"]
                shown = [r.status == "passed" for r in run_tests(program, code["tests"])]
                hidden = [r.status == "passed" for r in run_tests(program, code["hidden"])]
                counts["shown"] += all(shown)
                counts["hidden"] += all(hidden)
                counts["both"] += all(shown) and all(hidden)
                counts["shown_tests"] += sum(shown)
                counts["hidden_tests"] += sum(hidden)
        n = len(examples)
        row = {"functions": n, **counts,
               **{f"{k}_rate": counts[k] / n for k in ("shown", "hidden", "both")},
               **{f"{k}_ci95": wilson(counts[k], n) for k in ("shown", "hidden", "both")}}
        results["levels"][str(level)] = row
        print(f"level {level}: all shown pass {row['shown_rate']:.0%} {row['shown_ci95']}, all hidden pass "
              f"{row['hidden_rate']:.0%} {row['hidden_ci95']} ({n} functions)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
