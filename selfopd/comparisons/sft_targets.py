"""What `selfopd sft` trains on: (student prompt ids -> completion ids) pairs, either the data's
worked solutions or the model's own verified answers given privileged context."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from selfopd.engines.base import SamplingParams
from selfopd.data.example import Example
from selfopd.config.settings import fail

if TYPE_CHECKING:
    from selfopd.templating.chat_format import ChatFormat


@dataclass(frozen=True)
class Target:
    """One SFT pair: the student prompt's ids and the exact completion ids to learn."""

    example_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str


@dataclass
class TargetStats:
    """What happened to the candidate targets (for the summary)."""

    kind: str
    items: int = 0
    drawn: int = 0
    kept: int = 0
    wrong: int = 0
    unfinished: int = 0  # sampled: hit max_tokens; solution: longer than max_target_tokens
    duplicate: int = 0
    fixed: int = 0  # solution: "The final answer is X." appended


def resolve_targets(targets: str, examples: Sequence[Example]) -> str:
    """'solution' or 'sampled': what `sft.targets` ('auto', 'solution', 'sampled') means for
    these training examples."""
    if targets != "auto":
        if targets == "solution":
            missing = [e.id for e in examples if not e.solution]
            if missing:
                fail("sft.targets", f"'solution' but {len(missing)} of {len(examples)} training items have no worked "
                      f"solution (e.g. {missing[0]}); use 'sampled' or 'auto'")
        return targets
    return "solution" if examples and all(e.solution for e in examples) else "sampled"


def solution_targets(chat: ChatFormat, examples: Sequence[Example], student_template: Any, end_id: int,
                     max_target_tokens: int) -> tuple[list[Target], TargetStats]:
    """Worked solutions as completions, each verified to end in the reference answer; the prompts in
    the student's chat format `chat` (its tokenizer and model.chat_template_kwargs)."""
    from selfopd.templating.templates import render_student
    from selfopd.verifiers import verify_example

    stats = TargetStats("solution", items=len(examples), drawn=len(examples))
    tokenizer, targets = chat.tokenizer, []
    for example in examples:
        text = (example.solution or "").strip()
        if not verify_example(text, example).correct:
            text = f"{text}\n\nThe final answer is {example.answer}."
            stats.fixed += 1
            if not verify_example(text, example).correct:
                stats.wrong += 1
                continue
        completion = tokenizer.encode(text, add_special_tokens=False) + [end_id]
        if len(completion) > max_target_tokens:
            stats.unfinished += 1
            continue
        prompt = chat.prompt_ids(render_student(student_template, example))
        targets.append(Target(example.id, prompt, completion, text))
    stats.kept = len(targets)
    return targets, stats


def sampled_targets(engine: Any, chat: ChatFormat, examples: Sequence[Example], student_template: Any,
                    sample_template: Any, params: SamplingParams, batch_size: int,
                    progress: bool = True, teacher_chat: ChatFormat | None = None) -> tuple[list[Target], TargetStats]:
    """Rejection sampling with privileged context: sample from the teacher prompt (in `teacher_chat`, the
    teacher's chat format; None: the student's `chat`), keep the verified-correct, finished, distinct
    completions, paired with the *student* prompt. Batch number b samples with seed `params.seed * 1_000_003 + b`."""
    from tqdm.auto import tqdm

    from selfopd.templating.templates import render_student, render_teacher

    stats = TargetStats("sampled", items=len(examples))
    targets: list[Target] = []
    step = batch_size
    for number, start in enumerate(tqdm(range(0, len(examples), step), desc="sample", unit="batch", disable=not progress)):
        batch = examples[start : start + step]
        student = [render_student(student_template, e) for e in batch]
        teacher = [(teacher_chat or chat).prompt_ids(render_teacher(sample_template, e, m)) for e, m in zip(batch, student)]
        batch_params = dataclasses.replace(params, seed=params.seed * 1_000_003 + number)
        for example, messages, rollouts in zip(batch, student, engine.sample(teacher, batch_params)):
            keep, counts = select_rollouts(example, rollouts)
            for key, value in counts.items():
                setattr(stats, key, getattr(stats, key) + value)
            prompt = chat.prompt_ids(messages)
            targets.extend(Target(example.id, prompt, list(r.completion_ids), r.text) for r in keep)
    stats.kept = len(targets)
    return targets, stats


def select_rollouts(example: Example, rollouts: Sequence[Any]) -> tuple[list[Any], dict[str, int]]:
    """The rollouts worth learning: correct by the verifier, finished (not cut at max_tokens),
    and not a repeat of one already kept; with counts of each reason to drop."""
    from selfopd.verifiers import verify_example

    counts = {"drawn": len(rollouts), "wrong": 0, "unfinished": 0, "duplicate": 0}
    kept, seen = [], set()
    for rollout in rollouts:
        if rollout.finish_reason != "stop":
            counts["unfinished"] += 1
        elif not verify_example(rollout.text, example).correct:
            counts["wrong"] += 1
        elif tuple(rollout.completion_ids) in seen:
            counts["duplicate"] += 1
        else:
            seen.add(tuple(rollout.completion_ids))
            kept.append(rollout)
    return kept, counts
