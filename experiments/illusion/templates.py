"""Leaky vs clean privileged templates on the same student rollouts: does the illusion
score tell them apart?

    python -m experiments.illusion.templates                 # demo task, ~10 min on 2 CPU cores
    python -m experiments.illusion.templates --prompts 8 --samples 2 --gap-items 20   # quick look

The base student (the demo's packaged SmolLM2) samples `--prompts` x `--samples` rollouts
of the demo task once. Each teacher template then scores exactly those token ids with the
same weights (a `self` teacher at step 0): privileged gain by token class, illusion score,
wrong-context contrast, and the greedy accuracy gap the context opens on `--gap-items`
distinct held-out prompts. Intervals are over prompts. Prints a table and writes JSON (and a side-by-side heatmap of one rollout
under the leakiest and the cleanest template) to runs/experiments/ (`--out
experiments/illusion/results/illusion_templates.json` refreshes the shipped copy).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfopd.config import load_config
from selfopd.data import load_examples
from selfopd.diagnostics import Prompting, fresh_records
from selfopd.diagnostics.measures import as_jsonable
from selfopd.diagnostics.report import diagnose_template
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.core.heatmaps import plot_token_heatmaps_side_by_side
from selfopd.core.models import resolve_model
from selfopd.core.run_folder import portable_path
from selfopd.data.split import split_examples
from selfopd.templating.templates import load_template

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ("teacher/answer_hint_leaky", "teacher/answer_note", "teacher/reference_answer",
             "teacher/verifier_feedback", "teacher/empty")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "experiments" / "demo" / "demo.toml")
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--gap-items", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "experiments" / "illusion_templates.json")
    args = parser.parse_args()

    config = load_config(args.config)
    torch.set_num_threads(config.model.threads or torch.get_num_threads())
    examples = load_examples(config.data.spec)
    train_examples, eval_examples = split_examples(examples, eval_size=config.data.eval_size, seed=config.data.split_seed)
    folder = resolve_model(config.model.student)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LocalEngine(model, tokenizer, batch_size=config.eval.batch_size)
    student_template = load_template(config.data.student_template)
    params = SamplingParams(max_tokens=config.rollout.max_tokens, temperature=config.rollout.temperature,
                            n=args.samples, seed=config.run.seed)
    prompting = Prompting(tokenizer, student_template, load_template("teacher/empty"), {e.id: e for e in examples})
    records = fresh_records(engine, engine, train_examples[: args.prompts], prompting, params)

    results, diagnoses = [], {}
    for name in args.templates:
        diagnosis = diagnose_template(engine, records, prompting.with_teacher(load_template(name)),
                                      eval_examples[: args.gap_items], config.eval.max_tokens, progress=True)
        diagnoses[name] = diagnosis
        shares = {row.name: row.abs_share for row in diagnosis.decomposition}
        results.append({
            "template": name,
            "illusion_score": as_jsonable(diagnosis.illusion.share), "answer_token_share": diagnosis.illusion.token_share,
            "lift": diagnosis.illusion.lift, "warning": diagnosis.illusion.warning,
            "class_abs_share": as_jsonable(shares),
            "mean_abs_gain_per_token": sum(float(abs(r.advantage).sum()) for r in diagnosis.rollouts)
            / max(1, sum(len(r.advantage) for r in diagnosis.rollouts)),
            "contrast": as_jsonable(diagnosis.contrast), "gap": as_jsonable(diagnosis.gap),
        })

    print(f"\n{len(records)} rollouts ({args.prompts} distinct prompts x {args.samples}), "
          f"{sum(r.correct for r in records)} correct; gap on {args.gap_items} distinct held-out prompts (greedy)\n")
    header = (f"{'template':<28}{'illusion [95% CI]':>24}{'copy share':>12}{'|gain|/tok':>12}"
              f"{'follows ctx':>13}{'acc w/ ctx':>12}{'gap':>26}")
    print(header)
    for row, name in zip(results, args.templates):
        d = diagnoses[name]
        copy = next(r for r in d.decomposition if r.name == "answer_copy").abs_share
        print(f"{name:<28}{str(d.illusion.share):>24}{copy.value:>12.3f}{row['mean_abs_gain_per_token']:>12.3f}"
              f"{d.contrast.follows_context:>13.2f}{d.gap.with_context.value:>12.3f}{str(d.gap.gap).split(' (')[0]:>26}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": portable_path(args.config), "prompts": args.prompts, "samples": args.samples,
               "gap_items": args.gap_items, "rollouts": len(records), "student_accuracy_on_rollouts":
               sum(r.correct for r in records) / len(records), "results": results}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")

    scored = [n for n in args.templates if math.isfinite(diagnoses[n].illusion.share.value)]  # not the empty control
    if len(scored) < 2:
        return
    ranked = sorted(scored, key=lambda n: diagnoses[n].illusion.share.value)
    cleanest, leakiest = ranked[0], ranked[-1]
    index = max(range(len(records)), key=lambda i: float(abs(diagnoses[leakiest].rollouts[i].advantage).sum()))
    pieces = diagnoses[leakiest].rollouts[index].pieces.pieces
    figure = args.out.with_name("illusion_templates_heatmap.png")
    plot_token_heatmaps_side_by_side(
        pieces, {name: diagnoses[name].rollouts[index].advantage for name in (leakiest, cleanest)}, figure,
        title=f"Privileged gain on one rollout (item {records[index].id}, reference {records[index].answer})")
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
