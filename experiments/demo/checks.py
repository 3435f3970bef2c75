"""Does a finished demo run's gain hold beyond its own eval? Two checks, base vs trained:

    python -m experiments.demo.checks runs/demo-YYYYmmdd-HHMMSS      # ~15 minutes on 2 CPU cores

1. Answer budget: the run's held-out prompts at its eval budget (eval.max_tokens) and with a
   4x longer one. The base model explains before it answers and often runs out of tokens;
   a gain that disappears with room to finish is a gain in brevity, not in arithmetic.
2. Fresh prompts: `--fresh` prompts of the same task that the run's data never held
   (drawn past every training and held-out prompt, not "another seed"), at both budgets.

Every number is over distinct prompts, paired by prompt. Prints a table; writes JSON to
runs/experiments/demo_checks.json (`--out experiments/demo/results/demo_checks.json` refreshes the
shipped copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfopd.config import load_config
from selfopd.data import load_examples, parse_data_spec
from selfopd.engines.local import LocalEngine
from selfopd.run.evaluate import evaluate, outcomes_by_prompt
from selfopd.core.models import resolve_model
from selfopd.core.run_folder import RunFolder
from selfopd.data.split import SplitRecord, load_split
from selfopd.core.stats import paired_change, prompt_accuracy
from selfopd.templating.templates import load_template
from selfopd.training.trainer import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--fresh", type=int, default=400, help="fresh prompts of the run's task (default: 400)")
    parser.add_argument("--budget-factor", type=int, default=4, help="the longer budget, x eval.max_tokens (default: 4)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "experiments" / "demo_checks.json")
    args = parser.parse_args()

    config = load_config(RunFolder(args.run_dir).config)
    record = SplitRecord.read(args.run_dir)
    _, held_out = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    fresh_spec = dataclasses.replace(parse_data_spec(config.data.spec), size=args.fresh)
    fresh = load_examples(fresh_spec, exclude=set(record.eval_prompts) | set(record.train_prompts))
    sets = {"held-out": held_out, "fresh": fresh}
    budgets = (config.eval.max_tokens, args.budget_factor * config.eval.max_tokens)
    template = load_template(config.data.student_template)
    models = {"base": config.model.student, "trained": str(latest_checkpoint(args.run_dir))}

    outcomes: dict[tuple[str, str, int], dict[str, list[bool]]] = {}
    for label, spec_or_folder in models.items():
        folder = resolve_model(spec_or_folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        engine = LocalEngine(model, tokenizer, batch_size=config.eval.batch_size)
        for name, examples in sets.items():
            for budget in budgets:
                _, records = evaluate(engine, tokenizer, examples, template, budget, config.eval.batch_size,
                                      progress=False)
                outcomes[label, name, budget] = outcomes_by_prompt(records)
                print(f"{label:>8} {name:>9} {budget:>4} tokens: {prompt_accuracy(outcomes[label, name, budget])}",
                      flush=True)

    rows = []
    for name, examples in sets.items():
        for budget in budgets:
            base, trained = outcomes["base", name, budget], outcomes["trained", name, budget]
            change = paired_change(base, trained)
            rows.append({"prompts": name, "distinct_prompts": len(base), "max_tokens": budget,
                         "base": _interval(prompt_accuracy(base)), "trained": _interval(prompt_accuracy(trained)),
                         "change": {"mean": change.mean, "ci95": [change.low, change.high]}, "verdict": change.verdict})
    print(f"\n{'prompts':<10}{'n':>5}{'tokens':>8}{'base':>24}{'trained':>24}{'change':>28}")
    for row in rows:
        base, trained, change = row["base"], row["trained"], row["change"]
        print(f"{row['prompts']:<10}{row['distinct_prompts']:>5}{row['max_tokens']:>8}"
              f"{base['value']:>9.3f} [{base['ci95'][0]:.3f}, {base['ci95'][1]:.3f}]"
              f"{trained['value']:>9.3f} [{trained['ci95'][0]:.3f}, {trained['ci95'][1]:.3f}]"
              f"{change['mean']:>+10.3f} [{change['ci95'][0]:+.3f}, {change['ci95'][1]:+.3f}]  {row['verdict']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": args.run_dir.name, "data": config.data.spec, "fresh_prompts": len(fresh),
                                    "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


def _interval(estimate) -> dict:
    return {"value": estimate.value, "ci95": [estimate.low, estimate.high]}


if __name__ == "__main__":
    main()
