"""Held-out accuracy of a model on a split, through the verifiers, with a 95% interval."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

from selfopd.example import Example
from selfopd.engines.base import Engine, SamplingParams
from selfopd.stats import Proportion, wilson_interval
from selfopd.templates import PromptTemplate, prompt_token_ids, render_student
from verifiers import verify_example


@dataclass(frozen=True)
class EvalRecord:
    """One example's outcome, written as a JSON line so a run can be inspected later."""

    id: str
    prompt: str
    completion: str
    extracted: str | None
    reference: str
    correct: bool
    finish_reason: str
    completion_tokens: int


def evaluate(
    engine: Engine,
    tokenizer: Any,
    examples: Sequence[Example],
    template: PromptTemplate,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    out_dir: Path | None = None,
    progress: bool = True,
) -> tuple[Proportion, list[EvalRecord]]:
    """Greedy accuracy on `examples`; with `out_dir`, writes eval.jsonl and summary.json."""
    records: list[EvalRecord] = []
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    batches = range(0, len(examples), batch_size)
    for start in tqdm(batches, desc="eval", unit="batch", disable=not progress):
        batch = examples[start : start + batch_size]
        prompts = [prompt_token_ids(tokenizer, render_student(template, e)) for e in batch]
        for example, (completion,) in zip(batch, engine.sample(prompts, params)):
            result = verify_example(completion.text, example)
            records.append(
                EvalRecord(
                    id=example.id,
                    prompt=example.prompt,
                    completion=completion.text,
                    extracted=result.extracted,
                    reference=example.answer,
                    correct=result.correct,
                    finish_reason=completion.finish_reason,
                    completion_tokens=len(completion.completion_ids),
                )
            )
    accuracy = wilson_interval(sum(r.correct for r in records), len(records))
    if out_dir is not None:
        write_eval(out_dir, accuracy, records, template.name)
    return accuracy, records


def write_eval(out_dir: Path, accuracy: Proportion, records: Sequence[EvalRecord], template_name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "eval.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record)) + "\n")
    summary = {
        "template": template_name,
        "n": accuracy.n,
        "correct": accuracy.k,
        "accuracy": accuracy.value,
        "ci95": [accuracy.low, accuracy.high],
        "truncated": sum(r.finish_reason == "length" for r in records),
        "mean_completion_tokens": sum(r.completion_tokens for r in records) / max(len(records), 1),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
