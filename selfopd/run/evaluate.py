"""Held-out accuracy of a model on a split, through the verifiers, with a 95% interval over
distinct prompts (each prompt counts once, whatever its copies or samples)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from selfopd.config import ConfigError, TrainConfig
from selfopd.core.atomic import write_json_atomic, write_lines_atomic
from selfopd.data.example import Example, prompt_key
from selfopd.data.mixture import task_of
from selfopd.engines.base import Engine, SamplingParams
from selfopd.core.faults import fault_point
from selfopd.core.stats import (MeanEstimate, Proportion, mean_interval, pass_ks, per_prompt_means, prompt_accuracy,
                                prompt_pass_at_k)
from selfopd.templating.templates import PromptTemplate, prompt_token_ids, render_student
from selfopd.verifiers import Grading, grade


@dataclass(frozen=True)
class EvalPrompting:
    """What an eval of a run renders and how it grades (`eval_prompting`)."""

    template: str  # the template's name, as the config gives it
    template_kwargs: dict[str, Any]  # the student's chat-template arguments, eval.chat_template_kwargs over them
    grading: Grading


def eval_prompting(config: TrainConfig) -> EvalPrompting:
    """The prompt template, chat-template arguments and grading of `config`'s evals, the in-run eval and
    `selfopd eval` alike: [eval]'s settings where set, else training's (`EvalConfig.template`,
    `template_kwargs`, `grading` decide)."""
    settings = config.eval
    return EvalPrompting(settings.template(config.data.student_template),
                         settings.template_kwargs(config.model.chat_template_kwargs),
                         Grading.of(settings.grading(config.verifier)))


@dataclass(frozen=True)
class EvalRecord:
    """One sampled answer's outcome, written as a JSON line so a run can be inspected later."""

    id: str
    sample: int  # 0..k-1 for avg@k; always 0 for greedy
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
    samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    grading: Grading = Grading(),
    template_kwargs: Mapping[str, Any] | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> tuple[Proportion | MeanEstimate, list[EvalRecord]]:
    """Accuracy on `examples`: greedy (the default), or avg@k with `samples` > 1 at
    `temperature` (and the `top_p`, `top_k`, `min_p` filters: `SamplingParams`), graded as
    `grading` (the run's [verifier]) reads a completion. With `out_dir`, writes eval.jsonl and
    summary.json (avg@k and pass@k). `template_kwargs`: the student's chat-template arguments
    (model.chat_template_kwargs)."""
    if samples > 1 and temperature == 0:
        raise ValueError("avg@k with k > 1 needs temperature > 0: greedy samples are identical")
    prompts = [prompt_token_ids(tokenizer, render_student(template, e), template_kwargs or {}) for e in examples]
    check_room(examples, prompts, max_new_tokens, getattr(engine, "max_scored_tokens", None))  # before any sampling
    opened = [grading.prompt_opens_reasoning(tokenizer, prompt) for prompt in prompts]  # a template's <think>
    records: list[EvalRecord] = []
    batches = range(0, len(examples), batch_size)
    for number, start in enumerate(tqdm(batches, desc="eval", unit="batch", disable=not progress)):
        batch = examples[start : start + batch_size]
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, n=samples, seed=seed + number)
        sampled = engine.sample(prompts[start : start + batch_size], params)
        for example, completions, opens in zip(batch, sampled, opened[start : start + batch_size]):
            for index, completion in enumerate(completions):
                result = grade(completion.text, example, finish_reason=completion.finish_reason, grading=grading,
                               opened=opens)
                records.append(
                    EvalRecord(
                        id=example.id,
                        sample=index,
                        prompt=example.prompt,
                        completion=completion.text,
                        extracted=result.extracted,
                        reference=example.answer,
                        correct=result.correct,
                        finish_reason=completion.finish_reason,
                        completion_tokens=len(completion.completion_ids),
                    )
                )
    accuracy = accuracy_of(records, samples)
    if out_dir is not None:
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                    "max_tokens": max_new_tokens, "seed": seed}
        write_eval(out_dir, accuracy, records, template.name, samples, temperature,
                   tasks={e.id: task_of(e) for e in examples}, grading=grading, sampling=sampling)
    return accuracy, records


def check_room(examples: Sequence[Example], prompts: Sequence[list[int]], max_new_tokens: int,
               context: int | None) -> None:
    """Each prompt leaves `max_new_tokens` of room in the model's `context` (None: unknown), or a
    ConfigError naming the first data row that does not: past its context a model's answers are
    garbage (positions it never learned) or a server's request fails mid-eval."""
    if context is None:
        return
    for example, prompt in zip(examples, prompts):
        if len(prompt) + max_new_tokens > context:
            raise ConfigError("eval.max_tokens", f"data row {example.id!r} of {example.meta.get('source', 'the data')}: "
                              f"its prompt ({len(prompt)} tokens) plus eval.max_tokens ({max_new_tokens}) exceeds the "
                              f"model's context of {context} tokens; shorten that prompt or lower eval.max_tokens")


def accuracy_of(records: Sequence[EvalRecord], samples: int = 1) -> Proportion | MeanEstimate:
    """Accuracy over distinct prompts: greedy on distinct prompts is a Wilson interval on
    k/n prompts; avg@k (or repeated prompts) the per-prompt mean with an interval over prompts."""
    return prompt_accuracy(outcomes_by_prompt(records))


def at_k(records: Sequence[EvalRecord], samples: int) -> dict[str, Any]:
    """summary.json's avg@k and pass@k (k: the powers of two up to `samples`, and `samples`), each
    {value, ci95, n}: a mean over distinct prompts of each prompt's estimate from its answers."""
    outcomes = outcomes_by_prompt(records)
    estimates = {f"avg@{samples}": mean_interval(list(per_prompt_means(outcomes).values()))}
    estimates |= {f"pass@{k}": prompt_pass_at_k(outcomes, k) for k in pass_ks(samples)}
    return {"k": samples, **{name: {"value": e.value, "ci95": [e.low, e.high], "n": e.n} for name, e in estimates.items()}}


def outcomes_by_prompt(records: Sequence[EvalRecord | dict]) -> dict[str, list[bool]]:
    """Prompt key -> the correctness of each of its records (samples, or repeated items)."""
    outcomes: dict[str, list[bool]] = {}
    for record in records:
        row = record if isinstance(record, dict) else asdict(record)
        outcomes.setdefault(prompt_key(row["prompt"]), []).append(bool(row["correct"]))
    return outcomes


def read_eval_outcomes(eval_dir: Path) -> dict[str, list[bool]]:
    """`outcomes_by_prompt` of an eval folder's eval.jsonl (a run's eval/step_N, `selfopd eval --out`)."""
    path = Path(eval_dir) / "eval.jsonl"
    return outcomes_by_prompt([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def write_eval(
    out_dir: Path,
    accuracy: Proportion | MeanEstimate,
    records: Sequence[EvalRecord],
    template_name: str,
    samples: int = 1,
    temperature: float = 0.0,
    tasks: dict[str, str] | None = None,
    grading: Grading = Grading(),
    sampling: Mapping[str, Any] | None = None,
) -> None:
    """eval.jsonl, then summary.json (its presence marks the eval finished), each whole or absent.
    `tasks` (item id -> task, a mixture's): summary.json also holds each task's accuracy.
    `sampling`: the sampling settings, recorded as given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(out_dir / "eval.jsonl", (asdict(record) for record in records))
    fault_point("eval.written")
    truncated = sum(r.finish_reason == "length" for r in records)
    summary = {
        "template": template_name,
        "metric": "greedy accuracy" if samples == 1 else f"avg@{samples} accuracy at temperature {temperature}",
        "n": accuracy.n,  # distinct prompts
        "prompts": accuracy.n,
        "items": len({r.id for r in records}),
        "samples_per_item": samples,
        "accuracy": accuracy.value,
        "ci95": [accuracy.low, accuracy.high],
        "truncated": truncated,
        # Shares of the answers (records): cut at max_tokens; with nothing graded (truncated and
        # verifier.truncated = 'wrong', an unclosed reasoning block, or no final answer found).
        "truncated_share": truncated / max(len(records), 1),
        "no_answer_share": sum(r.extracted is None for r in records) / max(len(records), 1),
        "verifier": asdict(grading),
        "mean_completion_tokens": sum(r.completion_tokens for r in records) / max(len(records), 1),
        **({"sampling": dict(sampling)} if sampling else {}),
        **at_k(records, samples),
    }
    if tasks and len(set(tasks.values())) > 1:
        by_task = {}
        for task in dict.fromkeys(tasks.values()):
            part = accuracy_of([r for r in records if tasks[r.id] == task], samples)
            by_task[task] = {"accuracy": part.value, "ci95": [part.low, part.high], "n": part.n}
        summary["by_task"] = by_task
    write_json_atomic(out_dir / "summary.json", summary)
