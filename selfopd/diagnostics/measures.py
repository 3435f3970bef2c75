"""What the diagnostics measure, from annotated rollouts: where the teacher's advantage
sits (by token class), the illusion score, and epistemic words, length and leakage over
training. Every share comes with a bootstrap 95% interval over prompts: the samples of one
prompt (and its rollouts at other steps) share its difficulty and its answer, so they are
one observation, and resampling rollouts would make intervals too narrow."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from selfopd.core.turns import segments
from selfopd.run.rollouts import RolloutDigest, RolloutRecord
from selfopd.diagnostics.tokens import (
    ANSWER_CLASSES,
    CLASSES,
    TokenPieces,
    classify_tokens,
    epistemic_count,
    leaked_phrases,
)
from selfopd.core.stats import MeanEstimate, correct_minus_wrong, mean_interval

ENVIRONMENT = "environment"  # the class of an episode's environment ids: context, in no class of CLASSES

# The illusion score warns when the answer tokens hold clearly more of the teacher's |advantage|
# than of the tokens: at least ILLUSION_LIFT times their share of tokens, with the score's
# interval above that share. A lift, not a fixed share: the answer tokens' share of tokens
# depends on the task and on how long the answers are (5.5% of tokens on the demo task, 8% on
# chain_sum), and a fixed share calibrated on one task (0.25 on chain_sum) never fired on the
# other. Calibrated with experiments/illusion/templates.py (128 base-model rollouts, the
# teachers' privileged gain): templates that state the answer after the question lift
# 1.8x on the demo task (intervals from 1.1x) and 5.3-5.5x on chain_sum; clean ones 0.6-0.8x
# and 1.0-1.1x. docs/results/illusion.md, "Leaky vs clean templates".
ILLUSION_LIFT = 1.5
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Annotated:
    """A rollout with its token texts, token classes and per-token advantage to analyse.

    In an episode the environment's ids are context, never trained: their class is
    `ENVIRONMENT` (in no class of `CLASSES`) and their advantage 0, whatever values are given,
    so no statistic over tokens or classes counts them."""

    record: RolloutRecord
    pieces: TokenPieces
    classes: list[str]
    advantage: np.ndarray  # (T,) float64, usually teacher - student logprob; 0 at an episode's environment ids
    leaks: list[str]  # phrases in the output that refer to or copy privileged context

    def __post_init__(self) -> None:
        if self.record.loss_mask is not None:
            # A frozen dataclass: set once here, so `dataclasses.replace(a, advantage=...)` is masked too.
            object.__setattr__(self, "advantage", np.where(self.own, np.asarray(self.advantage, dtype=np.float64), 0.0))

    @property
    def own(self) -> np.ndarray:
        """(T,) bool: the tokens the student wrote (all of them outside an episode)."""
        return np.asarray(self.record.students, dtype=bool)

    @property
    def student_tokens(self) -> int:
        return int(self.own.sum())

    @property
    def student_text(self) -> str:
        """The student's own text: its turns, one line apart (the whole completion outside an episode)."""
        return self.pieces.text if self.record.loss_mask is None else students_pieces(self.pieces, self.record.students).text

    def in_classes(self, *names: str) -> np.ndarray:
        """(T,) bool: which tokens belong to any of the classes `names` (never an environment id)."""
        return np.array([c in names for c in self.classes], dtype=bool) & self.own


@dataclass(frozen=True)
class Share:
    """A ratio of sums over rollouts, with a bootstrap 95% interval over prompts."""

    value: float
    low: float
    high: float
    n: int  # distinct prompts

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class ClassRow:
    name: str
    tokens: int
    token_share: float
    abs_share: Share  # share of total |advantage|
    mean: float  # mean advantage per token of this class (signed)


@dataclass(frozen=True)
class IllusionScore:
    """Share of the total |advantage| on answer tokens (`ANSWER_CLASSES`), and how much
    more than their share of tokens that is (lift)."""

    share: Share
    token_share: float
    lift_threshold: float = ILLUSION_LIFT

    @property
    def lift(self) -> float:
        return self.share.value / self.token_share if self.token_share else math.nan

    @property
    def threshold(self) -> float:
        """The score above which this batch warns: `lift_threshold` x the answer tokens' share."""
        return self.lift_threshold * self.token_share

    @property
    def warning(self) -> bool:
        """Lift at least `lift_threshold`, and the interval above the answer tokens' share."""
        return bool(self.lift >= self.lift_threshold and self.share.low > self.token_share)


def students_pieces(pieces: TokenPieces, students: Sequence[bool]) -> TokenPieces:
    """The student's tokens of an episode alone: its turns' texts one line apart, so that nothing
    the environment wrote can make a student token an answer, a copy or an epistemic word."""
    text, kept, spans = "", [], []
    for number, segment in enumerate(s for s in segments(students) if s.student):
        if number:
            text += "\n"
        for piece in pieces.pieces[segment.start:segment.end]:
            kept.append(piece)
            spans.append((len(text), len(text) + len(piece)))
            text += piece
    return TokenPieces(text, kept, spans)


def annotate(
    record: RolloutRecord,
    pieces: TokenPieces,
    answer: str,
    privileged_text: str,
    student_prompt: str,
    extracted_answer: str | None,
    special_tokens: frozenset[str] = frozenset(),
    advantage: Sequence[float] | None = None,
) -> Annotated:
    """Classify a rollout's tokens; `advantage` defaults to the saved teacher - student. In an episode
    only the student's own text is classified and searched for leaks; the environment's ids are
    class `ENVIRONMENT`."""
    own = pieces if record.loss_mask is None else students_pieces(pieces, record.students)
    own_classes = iter(classify_tokens(own, answer, privileged_text, student_prompt, extracted_answer, special_tokens,
                                       correct=record.correct))
    classes = [next(own_classes) if mine else ENVIRONMENT for mine in record.students]
    values = np.asarray(record.opd_advantage if advantage is None else advantage, dtype=np.float64)
    annotated = Annotated(record, pieces, classes, values, [])
    return dataclasses.replace(annotated, leaks=leaked_phrases(annotated.student_text, privileged_text, student_prompt))


def ratio_share(numerators: Sequence[float], denominators: Sequence[float], clusters: Sequence[str] | None = None,
                seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> Share:
    """sum(numerators) / sum(denominators) with a percentile bootstrap over clusters (the
    prompts: pairs of one cluster are summed first and resampled together; default: each
    pair its own cluster)."""
    if clusters is not None:
        numerators, denominators = _sum_by_cluster(numerators, clusters), _sum_by_cluster(denominators, clusters)
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if len(num) == 0 or den.sum() == 0:
        return Share(math.nan, math.nan, math.nan, len(num))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(num), size=(samples, len(num)))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = num[picks].sum(1) / den[picks].sum(1)
    boot = boot[np.isfinite(boot)]
    low, high = np.percentile(boot, [2.5, 97.5]) if len(boot) else (math.nan, math.nan)
    return Share(float(num.sum() / den.sum()), float(low), float(high), len(num))


def _sum_by_cluster(values: Sequence[float], clusters: Sequence[str]) -> list[float]:
    sums: dict[str, float] = {}
    for value, cluster in zip(values, clusters, strict=True):
        sums[cluster] = sums.get(cluster, 0.0) + float(value)
    return list(sums.values())


def _prompts(rollouts: Sequence[Annotated]) -> list[str]:
    return [r.record.prompt for r in rollouts]


def decompose(rollouts: Sequence[Annotated]) -> list[ClassRow]:
    """Total |advantage| split by token class, each class's share with its interval."""
    total_abs = [float(np.abs(r.advantage).sum()) for r in rollouts]
    total_tokens = sum(r.student_tokens for r in rollouts)
    rows = []
    for name in CLASSES:
        in_class = [r.in_classes(name) for r in rollouts]
        class_abs = [float(np.abs(r.advantage[m]).sum()) for r, m in zip(rollouts, in_class)]
        values = np.concatenate([r.advantage[m] for r, m in zip(rollouts, in_class)]) if rollouts else np.zeros(0)
        tokens = int(sum(m.sum() for m in in_class))
        rows.append(ClassRow(
            name, tokens, tokens / total_tokens if total_tokens else math.nan,
            ratio_share(class_abs, total_abs, _prompts(rollouts)), float(values.mean()) if tokens else math.nan,
        ))
    return rows


def illusion_score(rollouts: Sequence[Annotated], lift_threshold: float = ILLUSION_LIFT) -> IllusionScore:
    """The illusion score: the share of the teacher's total |advantage| that sits on tokens
    stating the answer (copying the reference, or the student's own wrong final answer).

    A teacher that read the answer off its context and teaches only that concentrates its
    signal there: the student is pushed to state an answer it was never shown, not to get
    better at reaching it. When it is `lift_threshold` (`ILLUSION_LIFT`) times the answer
    tokens' share of tokens or more, clearly so, the report warns. On arithmetic a
    student can still learn to compute what the teacher copies, so a high score is a
    warning to check the wrong-context contrast and held-out accuracy, not a verdict.
    """
    answer_abs, total_abs, answer_tokens, tokens = [], [], 0, 0
    for r in rollouts:
        mask = r.in_classes(*ANSWER_CLASSES)
        answer_abs.append(float(np.abs(r.advantage[mask]).sum()))
        total_abs.append(float(np.abs(r.advantage).sum()))
        answer_tokens += int(mask.sum())
        tokens += r.student_tokens
    return IllusionScore(ratio_share(answer_abs, total_abs, _prompts(rollouts)),
                         answer_tokens / tokens if tokens else math.nan, lift_threshold)


@dataclass(frozen=True)
class StepBehaviour:
    """What the student's outputs look like at one training step."""

    step: int
    rollouts: int
    length: MeanEstimate  # the student's completion tokens (an episode's turns together, not the environment's)
    epistemic_per_100: float  # epistemic words per 100 of the student's tokens
    leak_rate: float  # share of rollouts with a leaked phrase
    accuracy: float  # share of rollouts the verifier accepted
    at_cap: float  # share of rollouts with a reply (an episode's turn) as long as the token cap (cut off, or nearly)


def step_behaviour(step: int, rollouts: Sequence[Annotated], max_tokens: int | None = None) -> StepBehaviour:
    """What the student wrote at `step`: only its own tokens and text, never an episode's environment's."""
    lengths = [r.student_tokens for r in rollouts]
    words = sum(epistemic_count(r.student_text) for r in rollouts)
    count = max(len(rollouts), 1)
    return StepBehaviour(
        step, len(rollouts), mean_interval([float(n) for n in lengths], unit_range=False, unit="rollouts"),
        100 * words / max(sum(lengths), 1),
        sum(bool(r.leaks) for r in rollouts) / count,
        sum(r.record.correct for r in rollouts) / count,
        sum(_longest_reply(r) >= max_tokens for r in rollouts) / count if max_tokens else 0.0,
    )


def _longest_reply(rollout: Annotated) -> int:
    """The student's longest turn in tokens: max_tokens caps each turn of an episode, not their sum."""
    return max((s.end - s.start for s in segments(rollout.record.students) if s.student), default=0)


def collapse_warnings(behaviour: Sequence[StepBehaviour], metrics: Sequence[dict] = (), drop: float = 0.5) -> list[str]:
    """Warnings that the student got worse at imitating a teacher it cannot match, comparing
    the first quarter of saved steps with the last: epistemic words or length falling by
    more than `drop`, answers running into the token cap, verifier accuracy halving, the
    reverse KL (from the run's `metrics`) falling while accuracy falls, leaked phrases."""
    if len(behaviour) < 2:
        return []
    quarter = max(1, len(behaviour) // 4)
    first, last = behaviour[:quarter], behaviour[-quarter:]
    span = f"(steps {first[0].step}-{first[-1].step} vs {last[0].step}-{last[-1].step})"

    def mean(rows: Sequence[StepBehaviour], field: str) -> float:
        return float(np.mean([getattr(b, field) if field != "length" else b.length.value for b in rows]))

    warnings = []
    for field, name in (("epistemic_per_100", "epistemic words per 100 tokens"), ("length", "response length")):
        before, after = mean(first, field), mean(last, field)
        if before > 0 and after < (1 - drop) * before:
            warnings.append(f"{name} fell from {before:.2f} to {after:.2f} {span}: a sign of collapse toward "
                            "the teacher's shortcut")
    before, after = mean(first, "at_cap"), mean(last, "at_cap")
    if after >= 0.5 and after > before + 0.2:
        warnings.append(f"responses run into the token cap: {before:.0%} -> {after:.0%} of rollouts {span}; "
                        "the student imitates a teacher that wants longer answers than it can finish")
    before, after = mean(first, "accuracy"), mean(last, "accuracy")
    if before >= 0.1 and after < (1 - drop) * before:
        warnings.append(f"verifier accuracy of the training rollouts fell from {before:.2f} to {after:.2f} {span}")
        kl = [(m["step"], m["opd/reverse_kl"]) for m in metrics if m.get("opd/reverse_kl") is not None]
        if len(kl) >= 2:
            cut = max(1, len(kl) // 4)
            kl_before, kl_after = np.mean([v for _, v in kl[:cut]]), np.mean([v for _, v in kl[-cut:]])
            if kl_after < kl_before:
                warnings.append(f"the reverse KL to the teacher fell ({kl_before:.3f} -> {kl_after:.3f}) while accuracy "
                                "fell: the student is getting closer to the teacher without getting better, the "
                                "privileged illusion's signature")
    leaky = [b for b in behaviour if b.leak_rate > 0]
    if leaky:
        worst = max(leaky, key=lambda b: b.leak_rate)
        warnings.append(f"student outputs refer to or copy privileged context at {len(leaky)} step(s), "
                        f"up to {worst.leak_rate:.0%} of rollouts (step {worst.step})")
    return warnings


@dataclass(frozen=True)
class ContextContrast:
    """The same rollouts scored by the teacher with the correct and with a wrong privileged
    context (a wrong answer, another item's hints and solution)."""

    mean_gain_correct: dict[str, float]  # per class: mean privileged gain per token
    mean_gain_wrong: dict[str, float]
    answer_share_of_difference: Share  # share of sum |gain - gain_wrong| on answer tokens
    follows_context: float  # correct rollouts whose answer tokens gain more with the correct context
    correct_rollouts: int


def context_contrast(rollouts: Sequence[Annotated], gains_correct: Sequence[np.ndarray],
                     gains_wrong: Sequence[np.ndarray]) -> ContextContrast:
    mean_correct, mean_wrong = {}, {}
    for name in CLASSES:
        masks = [r.in_classes(name) for r in rollouts]
        tokens = sum(int(m.sum()) for m in masks)
        mean_correct[name] = sum(float(g[m].sum()) for g, m in zip(gains_correct, masks)) / tokens if tokens else math.nan
        mean_wrong[name] = sum(float(g[m].sum()) for g, m in zip(gains_wrong, masks)) / tokens if tokens else math.nan
    answer_diff, total_diff, follows, correct = [], [], 0, 0
    for r, g, w in zip(rollouts, gains_correct, gains_wrong):
        mask = r.in_classes(*ANSWER_CLASSES)
        answer_diff.append(float(np.abs(g - w)[mask].sum()))
        total_diff.append(float(np.abs(g - w)[r.own].sum()))
        if r.record.correct and mask.any():
            correct += 1
            follows += float(g[mask].sum()) > float(w[mask].sum())
    return ContextContrast(mean_correct, mean_wrong, ratio_share(answer_diff, total_diff, _prompts(rollouts)),
                           follows / correct if correct else math.nan, correct)


def correct_preference(records: Sequence[RolloutRecord | RolloutDigest]) -> MeanEstimate | None:
    """Does the teacher's distillation signal favour the student's correct attempts?

    Per rollout, the mean per-token teacher - student logprob; per prompt group (one step's
    samples of one prompt) with both verified-correct and wrong samples, the correct
    samples' mean minus the wrong ones'; averaged per distinct prompt (a prompt met at
    several steps is one observation), then over prompts with a normal 95% interval over
    prompts. Comparing within a prompt cancels its difficulty. A teacher whose signal is not
    positive here pushes the student toward wrong answers as much as right ones, however
    much its KL falls. None when no group has both outcomes."""
    per_group = correct_minus_wrong(((r.step, r.group, r.prompt), bool(r.correct), r.opd_mean) for r in records)
    by_prompt: dict[str, list[float]] = {}
    for (_, _, prompt), contrast in per_group.items():
        by_prompt.setdefault(prompt, []).append(contrast)
    contrasts = [sum(values) / len(values) for values in by_prompt.values()]
    return mean_interval(contrasts, unit_range=False) if contrasts else None


def as_jsonable(value: Any) -> Any:
    """Dataclasses, numpy numbers and nan as plain JSON values (nan becomes null)."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        return as_jsonable(asdict(value))
    if isinstance(value, dict):
        return {k: as_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_jsonable(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
