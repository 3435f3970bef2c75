"""The teacher's side of a step, in one place: each rollout, with the verdict the step's grading
gave it (`selfopd.training.grading`), has the teacher's prompt built around the student's exact
completion, and every (teacher prompt, completion) pair is scored by the teacher engine.

The prompt (`teacher_rows`): the teacher template rendered with the example's privileged
context (reference answer, worked solution, hints), the student's question and completion,
the verifier's feedback on it, and for a template that uses `demonstration` the text of a
correct sibling of the same step (`selfopd.templating.demonstrations`). With
`loss.opd_baseline = "wrong_context"` a second prompt gives the same template a wrong context
(`selfopd.templating.wrong_context`); with `"same_engine"` the baseline is the student's own
prompt, scored by the teacher engine.

The scoring (`score_step`): in process, in the trainer's micro-batches, so that with the
empty-context control the teacher computes exactly what the student does, bit for bit (same
batch, same padding). An engine that schedules its own batches (vLLM: `Engine.batches_itself`)
gets the whole step in one call, the baseline's pairs in the same call, each distinct sequence
once. A teacher with its own tokenizer (`teacher.tokenizer = 'own'`) is prompted through its own
chat template and scores the completion's text as its own tokens (`selfopd.templating.token_bridge`);
its logprobs come back onto the student's tokens over aligned spans, and a completion that cannot be
aligned is masked (`Scored.aligned`). A full-vocabulary loss needs the teacher's whole next-token distributions: its final
hidden states are computed once per micro-batch, kept for the loss, and the sampled tokens'
logprobs read off them (the same numbers as a second forward: same weights, same batches)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from selfopd.config import DEFAULT_TEACHER, FULL_VOCABULARY, TeacherConfig, TrainConfig, teacher_key
from selfopd.data.example import Example
from selfopd.engines.base import Engine, Rollout, TokenScores
from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.engines.scoring import right_pad
from selfopd.templating.context_limits import check_teacher_rows
from selfopd.templating.demonstrations import pick_demonstrations
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import PromptTemplate, render_teacher
from selfopd.templating.token_bridge import Bridged, TokenBridge
from selfopd.templating.wrong_context import failed_sibling_answers, wrong_example
from selfopd.training.grading import Graded, grade_groups, student_format
from selfopd.verifiers import VerifyResult

Pairs = Sequence[tuple[list[int], list[int]]]
States = tuple[torch.Tensor, torch.Tensor]  # the teacher's tempered final hidden states (B, C, H) and head (V, H)


@dataclass(frozen=True)
class TeacherSide:
    """One teacher of a run, as the teacher side of a step reads it; opened once, for the whole run, by
    `selfopd.training.teachers.open_teachers` (`training.state.Run.teachers`, by name)."""

    config: TrainConfig
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    template: PromptTemplate
    demonstration_fallback: PromptTemplate | None  # set iff the template uses `demonstration`
    per_micro: int  # rollouts per trainer micro-batch (the in-process teacher's batches)
    temperature: float  # the trained policy's temperature: the teacher's logits are tempered alike
    name: str  # 'default' ([teacher]) or a [teachers.NAME] table's NAME
    table: TeacherConfig  # its settings: [teacher], or its [teachers.NAME] table
    chat_kwargs: Mapping[str, Any]  # its chat-template arguments, merged over the student's (`template_kwargs`)
    bridge: TokenBridge | None = None  # teacher.tokenizer = 'own': the teacher's tokens and chat template

    @property
    def key(self) -> str:
        """Where its settings live, as errors name them: 'teacher' or 'teachers.NAME'."""
        return teacher_key(self.name)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The teacher's prompt ids: through its own chat template when it has its own tokenizer."""
        return self.bridge.prompt_ids(messages) if self.bridge else self.chat.prompt_ids(messages)

    @cached_property
    def chat(self) -> ChatFormat:
        """Its chat format (its tokenizer and merged chat-template arguments), built once per side."""
        return ChatFormat(self.tokenizer, self.chat_kwargs)


@dataclass(frozen=True)
class Scored:
    """One rollout with everything the loss needs."""

    example: Example
    group: int  # index of its prompt in the step: GRPO groups
    rollout: Rollout
    reward: float
    correct: bool
    teacher_logprobs: torch.Tensor  # (T,) over the completion tokens
    teacher_prompt: list[int]
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # (T, k) ids and logprobs, when the loss needs them
    demonstration: str | None = None  # the sibling's text the teacher saw (None: none, or not used)
    # (T,) the teacher engine under the baseline prompt of loss.opd_baseline (a wrong context, or the
    # student's own prompt for 'same_engine'); None for 'student'.
    baseline_logprobs: torch.Tensor | None = None
    # False: a teacher with its own tokenizer could not read this completion as text (`unaligned`
    # says why); it gets no teacher signal, and teacher_logprobs are a placeholder (the sampler's).
    aligned: bool = True
    unaligned: str | None = None
    teacher: str = DEFAULT_TEACHER  # which teacher scored it ([teachers.NAME]; 'default': [teacher])
    rejected: bool = False  # its answer was refused by its task's safe grammar (VerifyResult.rejected)
    no_answer: bool = False  # nothing to grade: no final answer found, an unclosed reasoning block, or truncated
    hidden_reward: float | None = None  # a code task's hidden tests (never in feedback): their pass fraction


@dataclass(frozen=True)
class TeacherRow:
    """One rollout, its verdict and what the teacher is shown."""

    example: Example
    group: int
    rollout: Rollout
    verdict: VerifyResult
    prompt_ids: list[int]
    demonstration: str | None
    wrong_prompt_ids: list[int] | None  # the wrong-context prompt, when the loss contrasts with one
    bridged: Bridged | None = None  # teacher.tokenizer = 'own': the completion as the teacher's tokens
    teacher: str = DEFAULT_TEACHER  # the name of the teacher that scores it

    @property
    def teacher_completion(self) -> list[int]:
        """The completion ids the teacher scores: the student's own, or the teacher's tokens of its text."""
        return self.bridged.teacher_ids if self.bridged is not None else self.rollout.completion_ids

    @property
    def aligned(self) -> bool:
        return self.bridged is None or self.bridged.alignment is not None


def teacher_step(side: TeacherSide, step: int, examples: Sequence[Example], student_messages: Sequence[list[dict]],
                 groups: Sequence[Sequence[Rollout]], first_group: int,
                 graded: Sequence[Graded] | None = None) -> tuple[list[Scored], list[States]]:
    """This rank's prompt groups verified, shown to the teacher and scored: (a Scored per rollout, in
    order, and the teacher's states per micro-batch for a full-vocabulary loss). `step` is the
    number of steps taken (seeds the choice of demonstrations and wrong answers)."""
    rows = teacher_rows(side, step, examples, student_messages, groups, first_group, graded)
    return score_rows(side, rows, step)


def teacher_rows(side: TeacherSide, step: int, examples: Sequence[Example], student_messages: Sequence[list[dict]],
                 groups: Sequence[Sequence[Rollout]], first_group: int,
                 graded: Sequence[Graded] | None = None) -> list[TeacherRow]:
    """The rows of this rank's prompt groups, in order (group `first_group` first), all for `side`."""
    return routed_rows({DEFAULT_TEACHER: side}, lambda _: DEFAULT_TEACHER, step, examples, student_messages, groups,
                       first_group, graded)


def routed_rows(sides: Mapping[str, TeacherSide], route: Callable[[Example], str], step: int,
                examples: Sequence[Example], student_messages: Sequence[list[dict]],
                groups: Sequence[Sequence[Rollout]], first_group: int,
                graded: Sequence[Graded] | None = None) -> list[TeacherRow]:
    """The rows of this rank's prompt groups, in order, each group's for the teacher `route` names, with
    the step's verdicts (`selfopd.training.grading`; None: graded here, under the student's format)."""
    if graded is None:
        config = next(iter(sides.values())).config
        graded = grade_groups(student_format(config, next(iter(sides.values())).tokenizer), examples, groups,
                              partial_credit=config.loss.partial_credit)
    rows = []
    for group, (example, messages, rollouts, grades) in enumerate(zip(examples, student_messages, groups, graded),
                                                                  first_group):
        name = route(example)
        other = examples[(group - first_group + 1) % len(examples)]  # another prompt's solution and hints
        rows += _group_rows(sides[name], name, step, group, example, messages, rollouts, other, grades)
    return rows


def demonstration_texts(rollouts: Sequence[Rollout], graded: Graded, strip_reasoning: bool) -> list[str]:
    """Each rollout's text as a sibling's demonstration: whole, or (`teacher.strip_reasoning`, SDPO's
    rule) what the user reads of it, its reasoning blocks dropped. Only correct rollouts are shown, and
    a correct one always has a final text; the whole text stands in where it has none."""
    if not strip_reasoning:
        return [r.text for r in rollouts]
    return [(graded.chat.read(r.text, r.finish_reason, opened).final or r.text).lstrip()
            for r, opened in zip(rollouts, graded.opened)]


def _group_rows(side: TeacherSide, name: str, step: int, group: int, example: Example, messages: list[dict],
                rollouts: Sequence[Rollout], other: Example, graded: Graded) -> list[TeacherRow]:
    """One prompt group's rows: each rollout, with its verdict, shown to the teacher `side`."""
    cfg = side.config
    contrastive = cfg.loss.opd_baseline == "wrong_context"
    # Feedback against the wrong answer only where a template shows feedback (verifying costs time).
    shows_feedback = any("feedback" in t.variables for t in (side.template, side.demonstration_fallback) if t)
    verdicts = graded.verdicts
    correct = [v.correct for v in verdicts]
    demonstrations = (pick_demonstrations(demonstration_texts(rollouts, graded, side.table.strip_reasoning), correct, seed=cfg.run.seed, step=step,
                                          group=group, skip_self=side.table.skip_self_success)
                      if side.demonstration_fallback is not None else [None] * len(rollouts))
    wrong_answers = (failed_sibling_answers([v.extracted for v in verdicts], correct, seed=cfg.run.seed,
                                            step=step, group=group) if contrastive else [None] * len(rollouts))
    rows = []
    for index, (rollout, verdict, demonstration, wrong_answer) in enumerate(zip(rollouts, verdicts, demonstrations,
                                                                                 wrong_answers)):
        def prompt(shown: Example, feedback: str) -> list[int]:
            return side.prompt_ids(render_teacher(
                side.template, shown, messages, rollout.text, feedback, demonstration,
                side.demonstration_fallback))

        wrong = wrong_example(example, other, seed=cfg.run.seed, answer=wrong_answer) if contrastive else None
        wrong_ids = None
        if wrong is not None:  # verifier feedback, too, as if the wrong answer were the reference
            wrong_ids = prompt(wrong, graded.against(index, rollout, wrong).feedback if shows_feedback
                               else verdict.feedback)
        bridged = side.bridge.completion(rollout.completion_ids) if side.bridge is not None else None
        rows.append(TeacherRow(example, group, rollout, verdict, prompt(example, verdict.feedback), demonstration,
                               wrong_ids, bridged, name))
    return rows


def score_routed(sides: Mapping[str, TeacherSide], rows: Sequence[TeacherRow], step: int
                 ) -> tuple[list[Scored], list[States]]:
    """Each teacher scores its rows (`score_rows`); the Scored come back in the rows' order. The
    states a full-vocabulary loss keeps are per micro-batch of one teacher: one teacher only."""
    names = list(dict.fromkeys(r.teacher for r in rows))
    if len(names) <= 1:
        return score_rows(sides[names[0] if names else DEFAULT_TEACHER], rows, step)
    by_row: dict[int, Scored] = {}
    for name in names:
        mine = [r for r in rows if r.teacher == name]
        scored, states = score_rows(sides[name], mine, step)
        assert not states, "a full-vocabulary loss is refused with several teachers (selfopd.config)"
        by_row |= {id(r): s for r, s in zip(mine, scored)}
    return [by_row[id(r)] for r in rows], []


def score_rows(side: TeacherSide, rows: Sequence[TeacherRow], step: int) -> tuple[list[Scored], list[States]]:
    """The teacher's logprobs of each row's completion after its prompt (and, for the loss's
    baseline, after the baseline prompt), once every prompt is known to fit the teacher's context.
    A row the teacher cannot read (its own tokenizer, a text that does not re-encode) is not scored."""
    loss = side.config.loss
    if side.table.kind == "none":  # GRPO alone: the sampler's logprobs stand in, and nothing reads them
        return [Scored(r.example, r.group, r.rollout, r.verdict.reward, r.verdict.correct,
                       torch.tensor(r.rollout.sampler_logprobs, dtype=torch.float32), r.prompt_ids, teacher=r.teacher,
                       rejected=r.verdict.rejected, no_answer=r.verdict.extracted is None,
                       hidden_reward=r.verdict.hidden_reward)
                for r in rows], []
    live = [r for r in rows if r.aligned]
    check_teacher_rows([(r.example.id, ids, r.teacher_completion) for r in live
                        for ids in (r.prompt_ids, r.wrong_prompt_ids) if ids is not None], side.engine, step + 1)
    top_k = loss.top_k if loss.divergence == "topk_reverse_kl" else 0
    baseline_pairs = ([(r.wrong_prompt_ids, r.teacher_completion) for r in live]
                      if loss.opd_baseline == "wrong_context"
                      else [(r.rollout.prompt_ids, r.rollout.completion_ids) for r in live]
                      if loss.opd_baseline == "same_engine" else None)
    scores, states, baseline_scores = score_step(
        side.engine, [(r.prompt_ids, r.teacher_completion) for r in live], baseline_pairs, side.per_micro, top_k,
        side.temperature, keep_states=loss.divergence in FULL_VOCABULARY)
    by_row = dict(zip(map(id, live), zip(scores, baseline_scores or [None] * len(live))))
    scored = []
    for r in rows:
        if id(r) not in by_row:  # masked: the sampler's logprobs stand in, and its OPD weight is 0
            placeholder = torch.tensor(r.rollout.sampler_logprobs, dtype=torch.float32)
            scored.append(Scored(r.example, r.group, r.rollout, r.verdict.reward, r.verdict.correct, placeholder,
                                 r.prompt_ids, None, r.demonstration,
                                 placeholder if loss.opd_baseline != "student" else None,
                                 aligned=False, unaligned=r.bridged.problem, teacher=r.teacher,
                                 rejected=r.verdict.rejected, no_answer=r.verdict.extracted is None,
                       hidden_reward=r.verdict.hidden_reward))
            continue
        s, base = by_row[id(r)]
        scored.append(Scored(r.example, r.group, r.rollout, r.verdict.reward, r.verdict.correct,
                             _on_student_tokens(r, s.logprobs), r.prompt_ids,
                             (s.topk_ids, s.topk_logprobs) if top_k else None, r.demonstration,
                             _on_student_tokens(r, base.logprobs) if base is not None else None, teacher=r.teacher,
                             rejected=r.verdict.rejected, no_answer=r.verdict.extracted is None,
                       hidden_reward=r.verdict.hidden_reward))
    return scored, states


def _on_student_tokens(row: TeacherRow, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Logprobs over the teacher's completion ids, carried onto the student's tokens when the teacher
    has its own tokenizer (the exact same tensor otherwise)."""
    return row.bridged.student_logprobs(teacher_logprobs) if row.bridged is not None else teacher_logprobs


def score_step(engine: Engine, pairs: Pairs, baseline_pairs: Pairs | None, per_micro: int, top_k: int,
               temperature: float, keep_states: bool) -> tuple[list[TokenScores], list[States], list[TokenScores] | None]:
    """(a TokenScores per pair, the teacher's states per micro-batch when `keep_states`, a TokenScores
    per baseline pair or None). The baseline pairs (a wrong context, the student's own prompt) are
    scored with top_k 0, a sampled-token signal."""
    if getattr(engine, "batches_itself", False) and not keep_states:
        if baseline_pairs and top_k:
            raise ValueError("a baseline pass scores the sampled token only (top_k 0)")
        together = list(pairs) + list(baseline_pairs or [])
        scores = score_distinct(engine, together, top_k if not baseline_pairs else 0, temperature)
        return scores[: len(pairs)], [], (scores[len(pairs):] if baseline_pairs is not None else None)
    scores, states = score_in_micro_batches(engine, pairs, per_micro, top_k, temperature, keep_states)
    baseline = (score_in_micro_batches(engine, baseline_pairs, per_micro, 0, temperature, False)[0]
                if baseline_pairs is not None else None)
    return scores, states, baseline


def score_distinct(engine: Engine, pairs: Pairs, top_k: int, temperature: float) -> list[TokenScores]:
    """`engine.score` of each distinct (prompt, completion) once, shared by the rows that repeat it: a
    GRPO group's identical samples, a baseline row identical to its teacher row (the empty-context
    control with `same_engine`). vLLM's batches do not promise equal numbers for equal rows (bf16
    kernels differ with the batch's shape), and a difference there is noise, never signal."""
    first: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    distinct = []
    for prompt, completion in pairs:
        key = (tuple(prompt), tuple(completion))
        if key not in first:
            first[key] = len(distinct)
            distinct.append((prompt, completion))
    scores = engine.score(distinct, top_k=top_k, temperature=temperature)
    return [scores[first[(tuple(prompt), tuple(completion))]] for prompt, completion in pairs]


def score_in_micro_batches(engine: Engine, pairs: Pairs, per_micro: int, top_k: int, temperature: float,
                           keep_states: bool) -> tuple[list[TokenScores], list[States]]:
    """(a TokenScores per pair, and per micro-batch the teacher's states when `keep_states`)."""
    scores: list[TokenScores] = []
    states: list[States] = []
    for start in range(0, len(pairs), per_micro):
        micro = pairs[start : start + per_micro]
        if not keep_states:
            scores.extend(engine.score(micro, top_k=top_k, temperature=temperature))
            continue
        hidden_BCH, head_VH = engine.completion_states(micro, temperature)
        states.append((hidden_BCH, head_VH))
        scores.extend(scores_from_states(hidden_BCH, head_VH, [completion for _, completion in micro]))
    return scores, states


@torch.no_grad()
def scores_from_states(hidden_BCH: torch.Tensor, head_VH: torch.Tensor,
                       completions: Sequence[list[int]]) -> list[TokenScores]:
    """The logprob of each completion token under the distributions `completion_states` gave,
    as an engine's `score` computes it (fp32 head, on the CPU)."""
    ids_BC, mask_BC = right_pad(completions, pad_id=0)
    device = hidden_BCH.device
    logprobs_BC = token_logprobs_from_hidden(hidden_BCH, head_VH, ids_BC.to(device), mask_BT=mask_BC.to(device))
    logprobs_BC = logprobs_BC.float().cpu()
    return [TokenScores(logprobs=logprobs_BC[row, : len(completion)].clone())
            for row, completion in enumerate(completions)]
