"""How much the fact sheet gives on the knowledge task before any training: greedy accuracy of the
base student, and of the same weights reading `teacher/fact_sheet` with the question's own sheet
and with another country's (the shuffled control), on the same held-out questions.

    python -m experiments.knowledge.probe                      # ~3 min on 2 CPU cores
    python -m experiments.knowledge.probe --items 24           # a quick look

A gap with the own sheet and none with a shuffled one is a teacher with information to give that
a student without the sheet does not have at the start (its reward is then ~0: GRPO alone has
nothing to learn from). Items are distinct held-out questions (`part=heldout`: phrasings no run
trains on); intervals are Wilson 95% over them, differences paired over them. Writes JSON to
runs/experiments/ (`--out experiments/knowledge/results/knowledge_probe.json` refreshes the shipped
copy)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfopd.core.models import resolve_model
from selfopd.data import load_examples
from selfopd.diagnostics import Prompting
from selfopd.diagnostics.context import context_gap, gap_baseline
from selfopd.diagnostics.measures import as_jsonable
from selfopd.engines.local import LocalEngine
from selfopd.templating.templates import load_template

ROOT = Path(__file__).resolve().parents[2]
SPEC = "kb:countries?part=heldout"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--items", type=int, default=96, help="distinct held-out questions (of 192)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "experiments" / "knowledge_probe.json")
    args = parser.parse_args()

    folder = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LocalEngine(model, tokenizer, batch_size=32)
    results = {"model": args.model, "spec": SPEC, "template": "teacher/fact_sheet", "items": args.items}
    chosen_ids = None
    baseline = None
    for sheet in ("own", "shuffled"):
        examples = load_examples(f"{SPEC}&sheet={sheet}")
        if chosen_ids is None:
            chosen_ids = sorted(random.Random(args.seed).sample([e.id for e in examples], args.items))
        by_id = {e.id: e for e in examples}
        items = [by_id[i] for i in chosen_ids]  # the same questions under both sheets
        prompting = Prompting(tokenizer, load_template("student/plain"), load_template("teacher/fact_sheet"), by_id)
        if baseline is None:  # the student's answers do not depend on the sheet
            baseline = gap_baseline(engine, engine, items, prompting, args.max_tokens, progress=True)
        gap = context_gap(engine, engine, items, prompting, args.max_tokens, progress=True, baseline=baseline)
        results[f"sheet_{sheet}"] = as_jsonable(gap)
        print(f"sheet={sheet}: student {gap.student}, with the sheet {gap.with_context}, gap {gap.gap}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
