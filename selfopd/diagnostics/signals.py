"""Per-token signals that say whether a teacher's disagreement can be learned, and where it
comes from: teachability, the contrastive gain, and the information/capability split.

- Teachability (after TA-OPD): the teacher's probability mass on the student's own top-k
  tokens at each position. Mass there is disagreement the student can act on by
  reweighting what it already considers; the tail (1 - mass) is the teacher wanting tokens
  the student does not consider at all.
- Contrastive gain (after CREDIT): log p_T(y_t | x, c_true) - log p_T(y_t | x, c_other),
  where c_other is another item's privileged context. What the teacher's score owes to
  this item's context rather than to having some context in that shape.
- DOPD split (the "privilege illusion"): the advantage log p_T(y | x, c) - log p_S(y | x)
  is information (log p_S(y | x, c) - log p_S(y | x): what the student itself gains from
  one look at the context) plus capability (log p_T(y | x, c) - log p_S(y | x, c): what
  the teacher's weights add). A self teacher is all information.

All arrays are float64, per completion token; every score uses the engines' tempered
distributions (`temperature`), as the trainer does.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from selfopd.diagnostics.context import Prompting, _score
from selfopd.diagnostics.measures import Annotated, Share, ratio_share
from selfopd.run.rollouts import DiagnosticsError, RolloutRecord
from selfopd.diagnostics.tokens import CLASSES
from selfopd.engines.base import Engine
from selfopd.data.example import Example
from selfopd.core.stats import MeanEstimate, mean_interval
from selfopd.verifiers import reference_answer

# A server returns only the top-J logprobs it is asked for; vLLM's default cap is 20.
TEACHER_TOP_J = 20


def teacher_mass_on(candidate_ids_TK: np.ndarray, teacher_topk_ids_TJ: np.ndarray,
                    teacher_topk_logprobs_TJ: np.ndarray) -> np.ndarray:
    """(T,) the teacher's probability summed over each position's candidate ids, from its
    own top-J entries: exact when every candidate is among them, a lower bound otherwise
    (a candidate outside the teacher's top-J is counted as 0)."""
    candidates_TK = np.asarray(candidate_ids_TK)
    ids_TJ, logprobs_TJ = np.asarray(teacher_topk_ids_TJ), np.asarray(teacher_topk_logprobs_TJ, dtype=np.float64)
    if candidates_TK.shape[0] != ids_TJ.shape[0] or ids_TJ.shape != logprobs_TJ.shape:
        raise ValueError(f"candidates {candidates_TK.shape}, teacher ids {ids_TJ.shape} and logprobs "
                         f"{logprobs_TJ.shape} must share their positions (T)")
    hit_TJ = (ids_TJ[:, :, None] == candidates_TK[:, None, :]).any(-1)
    return np.where(hit_TJ, np.exp(logprobs_TJ), 0.0).sum(-1)


@dataclass(frozen=True)
class Teachability:
    """One rollout's teachability: per token, the teacher's mass on the student's top-k."""

    mass: np.ndarray  # (T,) float64
    exact: bool  # False: from the teacher's top-J, a lower bound on the mass

    @property
    def tail(self) -> np.ndarray:
        """(T,) the teacher's mass outside the student's top-k (an upper bound when not exact)."""
        return 1.0 - self.mass


def teachability(student: Engine, teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting,
                 k: int = 5, teacher_k: int = TEACHER_TOP_J, temperature: float = 1.0,
                 batch_size: int = 16) -> list[Teachability]:
    """The teacher's mass on the student's top-k tokens at every completion position of each
    rollout. The student's top-k comes from the student prompt (`record.prompt_ids`), the
    teacher's distribution from the teacher prompt. Exact from the full vocabulary when the
    teacher runs in process; through a server from its top-`teacher_k` (a lower bound)."""
    if k < 1 or teacher_k < k:
        raise ValueError(f"teachability needs 1 <= k <= teacher_k, got k={k}, teacher_k={teacher_k}")
    completions = [list(r.completion_ids) for r in records]
    student_pairs = [(list(r.prompt_ids), c) for r, c in zip(records, completions)]
    teacher_pairs = [(prompting.teacher_ids(prompting.example(r.id), r.text, demonstration=r.demonstration), c) for r, c in zip(records, completions)]
    out = []
    for start in range(0, len(records), batch_size):
        batch = slice(start, start + batch_size)
        student_scores = student.score(student_pairs[batch], top_k=k, temperature=temperature)
        candidates = [s.topk_ids.numpy() for s in student_scores]  # (T, k) each
        if teacher.supports_full_vocabulary:
            masses = _full_vocabulary_mass(teacher, teacher_pairs[batch], candidates, temperature)
            out.extend(Teachability(m, exact=True) for m in masses)
        else:
            teacher_scores = teacher.score(teacher_pairs[batch], top_k=teacher_k, temperature=temperature)
            out.extend(Teachability(teacher_mass_on(c, t.topk_ids.numpy(), t.topk_logprobs.numpy()), exact=False)
                       for c, t in zip(candidates, teacher_scores))
    return out


@torch.no_grad()
def _full_vocabulary_mass(teacher: Engine, pairs: Sequence[tuple[list[int], list[int]]],
                          candidates: Sequence[np.ndarray], temperature: float) -> list[np.ndarray]:
    """Exact teacher mass on each position's candidates from its full next-token distribution."""
    hidden_BCH, head_VH = teacher.completion_states(pairs, temperature=temperature)
    masses = []
    for row, ((_, completion), candidates_TK) in enumerate(zip(pairs, candidates)):
        logits_TV = hidden_BCH[row, : len(completion)].float() @ head_VH.float().T
        logprobs_TV = logits_TV.double().log_softmax(-1).cpu()
        chosen_TK = logprobs_TV.gather(-1, torch.as_tensor(candidates_TK, dtype=torch.long))
        masses.append(chosen_TK.logsumexp(-1).exp().numpy())
    return masses


def other_item_example(example: Example, pool: Sequence[Example], seed: int = 0) -> Example:
    """The same question with ANOTHER item's privileged fields (its answer, solution and
    hints), the contrastive baseline of CREDIT: a context of the right shape that is not
    this item's. An item with a different reference answer is preferred. Reasoning-gym's
    scorer is dropped, so feedback is graded against the other item's answer. Seeded."""
    answer = reference_answer(example.answer).strip()
    others = sorted((e for e in pool if e.id != example.id), key=lambda e: e.id)
    if not others:
        raise DiagnosticsError(f"item {example.id!r}: the contrastive gain needs another item in the data")
    different = [e for e in others if reference_answer(e.answer).strip() != answer]
    other = random.Random(f"{seed}/{example.id}").choice(different or others)
    meta = {key: value for key, value in example.meta.items() if key != "reasoning_gym"}
    return dataclasses.replace(example, answer=other.answer, solution=other.solution, hints=other.hints, meta=meta)


def contrastive_gains(teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting,
                      temperature: float = 1.0, batch_size: int = 16, seed: int = 0) -> list[np.ndarray]:
    """Per token, log p_T(y_t | x, c_true, y<t) - log p_T(y_t | x, c_other, y<t), with c_other
    another item's privileged context (`other_item_example`)."""
    pool = list(prompting.examples_by_id.values())
    true_prompts, other_prompts = [], []
    for record in records:
        example = prompting.example(record.id)
        true_prompts.append(prompting.teacher_ids(example, record.text, demonstration=record.demonstration))
        other_prompts.append(prompting.teacher_ids(other_item_example(example, pool, seed), record.text,
                                                   demonstration=record.demonstration))
    completions = [r.completion_ids for r in records]
    true = _score(teacher, true_prompts, completions, batch_size, False, "true context", temperature)
    other = _score(teacher, other_prompts, completions, batch_size, False, "other item's context", temperature)
    return [t - o for t, o in zip(true, other)]


@dataclass(frozen=True)
class DopdSplit:
    """One rollout's teacher - student advantage, split as DOPD does."""

    information: np.ndarray  # (T,) log p_S(y | x, c) - log p_S(y | x)
    capability: np.ndarray  # (T,) log p_T(y | x, c) - log p_S(y | x, c)

    @property
    def advantage(self) -> np.ndarray:
        """(T,) log p_T(y | x, c) - log p_S(y | x): the two parts' sum, exactly."""
        return self.information + self.capability


def dopd_split(student: Engine, teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting,
               temperature: float = 1.0, batch_size: int = 16) -> list[DopdSplit]:
    """The advantage of each rollout split into information and capability. When `teacher`
    is `student` (a self teacher) the capability is zero by construction and not scored."""
    completions = [r.completion_ids for r in records]
    privileged = [prompting.teacher_ids(prompting.example(r.id), r.text, demonstration=r.demonstration)
                  for r in records]
    plain = _score(student, [r.prompt_ids for r in records], completions, batch_size, False, "student", temperature)
    informed = _score(student, privileged, completions, batch_size, False, "student with context", temperature)
    if teacher is student:
        taught = informed
    else:
        taught = _score(teacher, privileged, completions, batch_size, False, "teacher", temperature)
    return [DopdSplit(i - p, t - i) for p, i, t in zip(plain, informed, taught)]


def prompt_mean(records: Sequence[RolloutRecord], per_token: Sequence[np.ndarray]) -> MeanEstimate:
    """The mean per token of each rollout (the student's tokens: an episode's environment ids
    left out), averaged per distinct prompt (a prompt met several times is one observation),
    then over prompts with a normal 95% interval."""
    by_prompt: dict[str, list[float]] = {}
    for record, values in zip(records, per_token, strict=True):
        values = np.asarray(values)[np.asarray(record.students, dtype=bool)] if record.loss_mask is not None else values
        if len(values):
            by_prompt.setdefault(record.prompt, []).append(float(np.mean(values)))
    if not by_prompt:
        raise ValueError("no rollout has a completion token to average")
    return mean_interval([float(np.mean(v)) for v in by_prompt.values()], unit_range=False)


def information_share(rollouts: Sequence[Annotated], splits: Sequence[DopdSplit],
                      classes: Sequence[str] | None = None) -> Share:
    """Share of the split's total size, sum |information| / sum (|information| + |capability|),
    on the tokens of `classes` (default: all the student's), with a bootstrap interval over prompts.
    1: all information (a self teacher); 0: all capability. The capability share is 1 - it."""
    numerators, denominators = [], []
    for rollout, split in zip(rollouts, splits, strict=True):
        mask = rollout.in_classes(*classes) if classes is not None else rollout.own
        information = np.abs(split.information[mask]).sum()
        numerators.append(float(information))
        denominators.append(float(information + np.abs(split.capability[mask]).sum()))
    return ratio_share(numerators, denominators, [r.record.prompt for r in rollouts])


def information_by_class(rollouts: Sequence[Annotated], splits: Sequence[DopdSplit]) -> dict[str, Share]:
    """`information_share` per token class, and over all tokens ("all")."""
    return {"all": information_share(rollouts, splits), **{name: information_share(rollouts, splits, (name,))
                                                            for name in CLASSES}}
