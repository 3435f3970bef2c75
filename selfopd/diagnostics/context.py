"""The measurements that need a model: privileged gain on fresh or saved rollouts, the
wrong-context contrast, and the accuracy gap a privileged context opens before training.

Everything goes through the `Engine` interface, so a local model and vLLM servers work alike.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from selfopd.config import DEFAULT_TEACHER, TeacherConfig, TrainConfig, teacher_tables
from selfopd.config.teachers import chat_kwargs
from selfopd.templating.demonstrations import pick_demonstrations
from selfopd.diagnostics.measures import Annotated, annotate
from selfopd.run.rollouts import DiagnosticsError, RolloutRecord
from selfopd.diagnostics.tokens import privileged_only_text, token_pieces
from selfopd.engines.base import Engine, SamplingParams
from selfopd.data.example import Example
from selfopd.core.stats import PairedDifference, Proportion, paired_difference, wilson_interval
from selfopd.templating.templates import (
    PromptTemplate,
    load_template,
    render_student,
    render_teacher,
    uses_demonstration,
)
from selfopd.templating.chat_format import ChatFormat
from selfopd.verifiers import reference_answer, verify_example
from selfopd.templating.wrong_context import wrong_example

DEFAULT_DEMONSTRATION_FALLBACK = TeacherConfig().demonstration_fallback


@dataclass(frozen=True)
class Prompting:
    """How a student/teacher pair's prompts are made: the tokenizer, both templates, and
    the items (by id) that saved rollouts refer to."""

    tokenizer: Any
    student_template: PromptTemplate
    teacher_template: PromptTemplate
    examples_by_id: Mapping[str, Example]
    # The run's teacher.demonstration_fallback (None: the config's default), for templates that use `demonstration`.
    demonstration_fallback: PromptTemplate | None = None
    student_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # each role's chat-template arguments
    teacher_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def with_teacher(self, template: PromptTemplate) -> Prompting:
        return dataclasses.replace(self, teacher_template=template)

    def example(self, example_id: str) -> Example:
        try:
            return self.examples_by_id[example_id]
        except KeyError:
            raise DiagnosticsError(f"rollout of item {example_id!r}: no such item in the run's data "
                                   "(was data.spec changed?)") from None

    @functools.cached_property
    def student_chat(self) -> ChatFormat:
        """The student's chat format: the tokenizer and the student's chat-template arguments."""
        return ChatFormat(self.tokenizer, self.student_kwargs)

    @functools.cached_property
    def teacher_chat(self) -> ChatFormat:
        """The teacher's chat format: the tokenizer and the teacher's merged chat-template arguments."""
        return ChatFormat(self.tokenizer, self.teacher_kwargs)

    def student_ids(self, example: Example) -> list[int]:
        return self.student_chat.prompt_ids(render_student(self.student_template, example))

    def teacher_messages(self, example: Example, attempt: str, feedback: str | None = None,
                         demonstration: str | None = None) -> list[dict[str, str]]:
        """The teacher's messages for `attempt`, with feedback graded against this example's
        answer (pass `feedback` when the attempt is already graded). A template that uses
        `demonstration` renders the demonstration fallback when it is None, as in training
        (a saved rollout's `demonstration` re-renders its prompt exactly)."""
        if feedback is None:
            feedback = verify_example(attempt, example).feedback
        fallback = None
        if demonstration is None and uses_demonstration(self.teacher_template):
            fallback = self.demonstration_fallback or load_template(DEFAULT_DEMONSTRATION_FALLBACK)
        return render_teacher(self.teacher_template, example, render_student(self.student_template, example),
                              attempt, feedback, demonstration, fallback)

    def teacher_ids(self, example: Example, attempt: str, feedback: str | None = None,
                    demonstration: str | None = None) -> list[int]:
        return self.teacher_chat.prompt_ids(self.teacher_messages(example, attempt, feedback, demonstration))


def run_prompting(run_dir: Path, config: TrainConfig, examples: Sequence[Example],
                  teacher: str = DEFAULT_TEACHER) -> Prompting:
    """Prompts as the run at `run_dir` made them for `teacher` ('default': [teacher], else a
    [teachers.NAME] table): its student's tokenizer, the template texts it kept (RUN/templates/)
    and the teacher's demonstration fallback and chat-template arguments."""
    from transformers import AutoTokenizer

    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.run.templates import load_run_template

    tokenizer = from_pretrained(AutoTokenizer, resolve_model(config.model.student, config.model.revision),
                                trust_remote_code=config.model.trust_remote_code)
    table = teacher_tables(config)[teacher]
    return Prompting(tokenizer, load_run_template(run_dir, config.data.student_template),
                     load_run_template(run_dir, table.template), {e.id: e for e in examples},
                     load_run_template(run_dir, table.demonstration_fallback), *chat_kwargs(config, table))


def annotate_records(records: Sequence[RolloutRecord], prompting: Prompting, progress: bool = False) -> list[Annotated]:
    """Token texts, classes and leaks of rollouts. The privileged text is what the teacher
    template adds for that item (rendered again, as in training)."""
    special = frozenset(prompting.tokenizer.all_special_tokens)
    annotated = []
    for record in tqdm(records, desc="annotate", unit="rollout", disable=not progress):
        example = prompting.example(record.id)
        verdict = verify_example(record.text, example)
        student_prompt = _content(render_student(prompting.student_template, example))
        teacher_text = _content(prompting.teacher_messages(example, record.text, verdict.feedback,
                                                                record.demonstration))
        privileged = privileged_only_text(teacher_text, student_prompt, record.text)
        annotated.append(annotate(record, token_pieces(prompting.tokenizer, record.completion_ids),
                                  reference_answer(example.answer), privileged, student_prompt, verdict.extracted,
                                  special))
    return annotated


def privileged_gains(engine: Engine, records: Sequence[RolloutRecord], prompting: Prompting, batch_size: int = 16,
                     progress: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-token privileged gain of each rollout under the correct and under a wrong context:
    log p(y_t | x, c, y<t) - log p(y_t | x, y<t), same weights (the engine's) for both terms."""
    pool = list(prompting.examples_by_id.values())
    correct_prompts, wrong_prompts = [], []
    for index, record in enumerate(records):
        example = prompting.example(record.id)
        correct_prompts.append(prompting.teacher_ids(example, record.text, demonstration=record.demonstration))
        wrong_prompts.append(prompting.teacher_ids(wrong_example(example, _other_example(pool, example, index)),
                                                   record.text, demonstration=record.demonstration))
    completions = [r.completion_ids for r in records]
    plain = _score(engine, [r.prompt_ids for r in records], completions, batch_size, progress, "no context")
    correct = _score(engine, correct_prompts, completions, batch_size, progress, "correct context")
    wrong = _score(engine, wrong_prompts, completions, batch_size, progress, "wrong context")
    return [c - p for c, p in zip(correct, plain)], [w - p for w, p in zip(wrong, plain)]


def fresh_records(student: Engine, teacher: Engine, examples: Sequence[Example], prompting: Prompting,
                  params: SamplingParams, batch_size: int = 16, progress: bool = False) -> list[RolloutRecord]:
    """Sample the student now and score with the teacher: records like a run's step 0,
    with advantage = teacher - student (no verifier-reward term), both at the sampling
    temperature, as the trainer scores them."""
    records = student_records(student, examples, prompting, params, batch_size, progress)
    return rescored(teacher, records, prompting, params.temperature or 1.0, batch_size, progress)


def student_records(student: Engine, examples: Sequence[Example], prompting: Prompting, params: SamplingParams,
                    batch_size: int = 16, progress: bool = False, sample_chunk: int | None = None,
                    skip_self_success: bool = True) -> list[RolloutRecord]:
    """`params.n` rollouts of each example by the student, verified, with the student's
    logprobs at the sampling temperature (scored `batch_size` rollouts at a time, as
    `rescored` scores the teacher). No teacher has scored them yet: the teacher logprobs are
    the student's own (advantage 0) until `rescored`. `sample_chunk`: sample that many
    prompts per call (a progress bar; each row draws the same randomness when a chunk's rows
    are a multiple of the engine's batch); None: one call. Each record carries the sibling
    demonstration a `demonstration` template would see (`selfopd.templating.demonstrations`)."""
    prompts = [prompting.student_ids(e) for e in examples]
    chunk = sample_chunk or max(1, len(prompts))
    groups = []
    for start in tqdm(range(0, len(prompts), chunk), desc="student rollouts", unit="batch", disable=not progress):
        params_here = dataclasses.replace(params, first_row=params.first_row + start * params.n)
        groups.extend(student.sample(prompts[start : start + chunk], params_here))
    flat = [(group, e, r) for group, (e, rollouts) in enumerate(zip(examples, groups)) for r in rollouts]
    student_lp = _score(student, [r.prompt_ids for _, _, r in flat], [r.completion_ids for _, _, r in flat],
                        batch_size, progress, "student scores", params.temperature or 1.0)
    verdicts = [verify_example(rollout.text, example) for _, example, rollout in flat]
    demonstrations = []  # for templates that use `demonstration`: another correct sample of the group, as in training
    for group, rollouts in enumerate(groups):
        first = len(demonstrations)
        demonstrations += pick_demonstrations([r.text for r in rollouts],
                                              [v.correct for v in verdicts[first : first + len(rollouts)]],
                                              seed=params.seed or 0, step=0, group=group, skip_self=skip_self_success)
    records = []
    for (group, example, rollout), s, verdict, demonstration in zip(flat, student_lp, verdicts, demonstrations):
        records.append(RolloutRecord(
            step=0, id=example.id, group=group, prompt_ids=rollout.prompt_ids, completion_ids=rollout.completion_ids,
            text=rollout.text, sampler_logprobs=list(rollout.sampler_logprobs), student_logprobs=s.tolist(),
            teacher_logprobs=s.tolist(), advantage=[0.0] * len(s), reward=verdict.reward, correct=verdict.correct,
            answer=example.answer, demonstration=demonstration,
        ))
    return records


def rescored(teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting, temperature: float,
             batch_size: int = 16, progress: bool = False) -> list[RolloutRecord]:
    """The same rollouts scored by `teacher` after `prompting`'s teacher prompt, at
    `temperature`: advantage = teacher - student. Batched as the student was scored, so a
    teacher prompt equal to the student's (the `empty` control) gives exactly its logprobs."""
    teacher_prompts = [prompting.teacher_ids(prompting.example(r.id), r.text, demonstration=r.demonstration)
                       for r in records]
    teacher_lp = _score(teacher, teacher_prompts, [r.completion_ids for r in records], batch_size, progress,
                        "teacher scores", temperature)
    return [dataclasses.replace(r, teacher_logprobs=t.tolist(),
                                advantage=(t - np.asarray(r.student_logprobs, dtype=np.float64)).tolist())
            for r, t in zip(records, teacher_lp)]


@dataclass(frozen=True)
class ContextGap:
    """Greedy accuracy on the same items: the student, the teacher's weights alone (the
    student's own for a `self` teacher), and the teacher with its privileged context. The
    gap (with context - student) predicts how much a privileged teacher has to give; when
    it comes from a stated answer, it bounds the illusion, not an attainable target."""

    student: Proportion
    teacher_alone: Proportion
    with_context: Proportion
    gap: PairedDifference  # with_context - student, paired over items


@dataclass(frozen=True)
class GapBaseline:
    """What the gap compares against, the same for every template: the student's greedy
    answers to the items, whether they are right, and whether the teacher's weights alone are."""

    attempts: list[str]
    student_ok: list[bool]
    alone_ok: list[bool]


def gap_baseline(student: Engine, teacher: Engine, examples: Sequence[Example], prompting: Prompting,
                 max_tokens: int, batch_size: int = 32, progress: bool = False) -> GapBaseline:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain_prompts = [prompting.student_ids(e) for e in examples]
    attempts = _greedy(student, plain_prompts, params, batch_size, progress, "student")
    student_ok = _graded(attempts, examples)
    alone_ok = student_ok
    if teacher is not student:
        alone_ok = _graded(_greedy(teacher, plain_prompts, params, batch_size, progress, "teacher alone"), examples)
    return GapBaseline(attempts, student_ok, alone_ok)


def context_gap(student: Engine, teacher: Engine, examples: Sequence[Example], prompting: Prompting, max_tokens: int,
                batch_size: int = 32, progress: bool = False, baseline: GapBaseline | None = None) -> ContextGap:
    """A template that shows the teacher the student's attempt gets the student's greedy
    answer as that attempt. `teacher` may be `student` (self-distillation). `baseline`:
    `gap_baseline` of these engines and items, when several templates share it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if baseline is None:
        baseline = gap_baseline(student, teacher, examples, prompting, max_tokens, batch_size, progress)
    feedback = [verify_example(a, e).feedback for a, e in zip(baseline.attempts, examples)]
    context_prompts = [prompting.teacher_ids(e, a, f) for e, a, f in zip(examples, baseline.attempts, feedback)]
    context_ok = _graded(_greedy(teacher, context_prompts, params, batch_size, progress, "teacher with context"),
                         examples)
    return ContextGap(_proportion(baseline.student_ok), _proportion(baseline.alone_ok), _proportion(context_ok),
                      paired_difference(baseline.student_ok, context_ok))


def _graded(answers: Sequence[str], examples: Sequence[Example]) -> list[bool]:
    return [verify_example(a, e).correct for a, e in zip(answers, examples)]


def _proportion(outcomes: Sequence[bool]) -> Proportion:
    return wilson_interval(sum(outcomes), len(outcomes))


def _greedy(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch_size: int, progress: bool,
            label: str) -> list[str]:
    texts = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=label, unit="batch", disable=not progress):
        texts.extend(group[0].text for group in engine.sample(prompts[start : start + batch_size], params))
    return texts


def _score(engine: Engine, prompts: Sequence[list[int]], completions: Sequence[list[int]], batch_size: int,
           progress: bool, label: str, temperature: float = 1.0) -> list[np.ndarray]:
    """float64 logprobs of each completion after its prompt, in batches."""
    pairs = [(list(p), list(c)) for p, c in zip(prompts, completions)]
    out = []
    for start in tqdm(range(0, len(pairs), batch_size), desc=label, unit="batch", disable=not progress):
        scores = engine.score(pairs[start : start + batch_size], temperature=temperature)
        out.extend(s.logprobs.double().numpy() for s in scores)
    return out


def _other_example(pool: Sequence[Example], example: Example, seed: int) -> Example:
    """Another item (seeded choice) whose hints and solution make a wrong context."""
    others = [e for e in random.Random(seed).sample(list(pool), min(len(pool), 4)) if e.id != example.id]
    return others[0] if others else example


def _content(messages: Sequence[Mapping[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)
