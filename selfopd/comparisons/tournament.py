"""The template tournament (`selfopd prompts rank`): every teacher template scored on one fixed
set of student rollouts, before any training, and a pre-registered predicted order.

The rollouts are sampled once; each template's teacher scores exactly those token ids at the
rollout temperature, as the trainer would at step 0, so the templates differ only in what
the teacher is shown. Every interval's unit is the distinct prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from selfopd.diagnostics.context import (
    ContextGap,
    GapBaseline,
    Prompting,
    annotate_records,
    context_gap,
    gap_baseline,
    rescored,
    student_records,
)
from selfopd.diagnostics.measures import IllusionScore, Share, correct_preference, illusion_score, ratio_share
from selfopd.run.rollouts import RolloutRecord
from selfopd.diagnostics.signals import contrastive_gains, prompt_mean, teachability
from selfopd.engines.base import Engine, TokenScores
from selfopd.data.example import Example, prompt_key
from selfopd.core.stats import MeanEstimate

if TYPE_CHECKING:
    from selfopd.config import TrainConfig
    from selfopd.templating.templates import PromptTemplate

# The pre-registered rule, fixed before any training result was seen (docs/diagnostics.md,
# "Template tournament"): rank by teacher-prefers-correct, higher first. In the repo's comparison of
# teachers ("Comparing teachers") that column separated the teachers that helped from the one
# that made the student worse; the KL and the illusion score did not.
RULE = ("templates are ranked by teacher-prefers-correct (point estimate, higher first); a template whose "
        "advantage is exactly 0 on every token (the `empty` control with a self teacher) is placed at "
        "preference 0, since its training changes nothing by construction; a template whose preference is "
        "undefined (no prompt with both right and wrong samples) is ranked after all others")


@dataclass(frozen=True)
class TemplateScore:
    """One template's teacher signal on the fixed rollouts, and the gap it opens before training."""

    template: str
    gap: ContextGap  # greedy accuracy with the context - the student's, paired over held-out items
    preference: MeanEstimate | None  # teacher-prefers-correct; None: no prompt with mixed outcomes
    illusion: IllusionScore  # share of |advantage| on answer tokens, and its lift
    teachability: MeanEstimate  # teacher mass on the student's top-k tokens, per token
    tail: MeanEstimate  # teacher mass outside them (1 - teachability)
    contrastive: MeanEstimate  # log p_T(y | true context) - log p_T(y | another item's context), per token
    mean_advantage: Share  # teacher - student logprob per token: the sampled reverse-KL estimate, negated
    all_zero: bool  # every token's advantage is exactly 0: training on it changes nothing

    @property
    def rank_value(self) -> float | None:
        """The number the pre-registered rule ranks by (None: ranked last)."""
        if self.all_zero:
            return 0.0
        return self.preference.value if self.preference is not None else None


class ScoreCache:
    """An engine that answers a `score` request it has seen before from memory, and passes
    everything else to `engine`. A tournament asks the same questions once per template
    (the student's top-k on its own prompts, the teacher's logprobs after the true context);
    the answers do not change, so they are computed once. Requests are keyed by their exact
    token ids, batch by batch: what comes back is what the engine returned, bit for bit."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._answers: dict[tuple, list[TokenScores]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        key = (tuple((tuple(p), tuple(c)) for p, c in sequences), top_k, temperature)
        if key not in self._answers:
            self._answers[key] = self.engine.score(sequences, top_k=top_k, temperature=temperature)
        return self._answers[key]


def tournament_prompts(train: Sequence[Example], count: int, prompts_per_step: int, seed: int,
                       max_steps: int = 100_000) -> list[Example]:
    """The first `count` distinct prompts a run would see, in its step order
    (`trainer.batch_for_step` with the run's seed): the items a short run trains on."""
    from selfopd.training.trainer import batch_for_step

    chosen: dict[str, Example] = {}
    for step in range(max_steps):
        for example in batch_for_step(train, step, prompts_per_step, seed):
            chosen.setdefault(prompt_key(example.prompt), example)
            if len(chosen) == count:
                return list(chosen.values())
    return list(chosen.values())  # fewer distinct prompts than asked for in the whole training set


def score_template(student: Engine, teacher: Engine, records: Sequence[RolloutRecord], prompting: Prompting,
                   gap_examples: Sequence[Example], gap_max_tokens: int, temperature: float, batch_size: int,
                   baseline: GapBaseline | None = None, top_k: int = 5, seed: int = 0, progress: bool = False
                   ) -> tuple[TemplateScore, list[RolloutRecord]]:
    """`prompting`'s teacher template judged on `records` (the student's, scored by the
    student): the score, and the records with this teacher's logprobs and advantage.
    `baseline`: the gap's no-context side (`gap_baseline`), shared by every template;
    `top_k`: the student's candidates for teachability; `seed`: which other item's context
    the contrastive gain uses."""
    scored = rescored(teacher, records, prompting, temperature, batch_size, progress)
    annotated = annotate_records(scored, prompting)
    advantages = [np.asarray(r.advantage, dtype=np.float64) for r in scored]
    clusters = [r.prompt for r in scored]
    mean_advantage = ratio_share([float(a.sum()) for a in advantages], [float(len(a)) for a in advantages], clusters)
    teachable = teachability(student, teacher, scored, prompting, k=top_k, temperature=temperature,
                             batch_size=batch_size)
    gains = contrastive_gains(teacher, scored, prompting, temperature, batch_size, seed)
    gap = context_gap(student, teacher, gap_examples, prompting, gap_max_tokens, batch_size, progress, baseline)
    mass, tail = prompt_mean(scored, [t.mass for t in teachable]), prompt_mean(scored, [t.tail for t in teachable])
    score = TemplateScore(prompting.teacher_template.name, gap, correct_preference(scored), illusion_score(annotated),
                          mass, tail, prompt_mean(scored, gains), mean_advantage, all(not a.any() for a in advantages))
    return score, scored


def predicted_order(scores: Sequence[TemplateScore]) -> list[TemplateScore]:
    """`scores` in the order `RULE` predicts (best first); ties keep their given order."""
    defined = [s for s in scores if s.rank_value is not None and math.isfinite(s.rank_value)]
    undefined = [s for s in scores if s not in defined]
    return sorted(defined, key=lambda s: -s.rank_value) + undefined  # type: ignore[operator]


@dataclass(frozen=True)
class Tournament:
    """Every template's score on one fixed set of rollouts, in the predicted order."""

    ranked: list[TemplateScore]  # best first, by `RULE`
    settings: dict[str, object]  # what was sampled and scored, and how
    prompts: int  # distinct prompts the rollouts come from
    rollouts: int
    correct: int  # rollouts the verifier accepted
    gap_prompts: int  # distinct held-out prompts of the gap


def run_tournament(config: TrainConfig, templates: Sequence[PromptTemplate], prompts: int, samples: int,
                   gap_items: int, top_k: int = 5, progress: bool = True) -> Tournament:
    """Sample the student once on the first `prompts` distinct training prompts of `config`'s
    run (`samples` each, the rollout settings and seed), then score every template on them
    with the config's teacher (`teacher.kind`: the student's starting weights, or
    `teacher.model`) and measure its gap on the first `gap_items` held-out items."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from selfopd.data import load_examples
    from selfopd.engines.base import SamplingParams
    from selfopd.engines.build import engines_at_start, external_teacher_bridge
    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.data.split import distinct_prompts, split_examples
    from selfopd.config.teachers import chat_kwargs
    from selfopd.templating.templates import load_template

    if config.model.threads:
        torch.set_num_threads(config.model.threads)
    examples = load_examples(config.data.spec)
    train, held_out = split_examples(examples, eval_size=config.data.eval_size, seed=config.data.split_seed)
    items = tournament_prompts(train, prompts, config.rollout.prompts_per_step, config.run.seed)
    gap_examples = held_out[:gap_items]
    if config.teacher.kind == "external":  # another tokenizer is refused before any weights load
        external_teacher_bridge(config, from_pretrained(AutoTokenizer, resolve_model(config.model.student, config.model.revision),
                                                       trust_remote_code=config.model.trust_remote_code))
    student_engine, teacher_engine = engines_at_start(config)
    student = ScoreCache(student_engine)
    teacher = student if teacher_engine is student_engine else ScoreCache(teacher_engine)
    prompting = Prompting(student.tokenizer, load_template(config.data.student_template), templates[0],
                          {e.id: e for e in examples}, load_template(config.teacher.demonstration_fallback),
                          *chat_kwargs(config))
    temperature = config.rollout.temperature or 1.0
    batch_size = config.eval.batch_size
    params = SamplingParams(max_tokens=config.rollout.max_tokens, temperature=config.rollout.temperature,
                            top_p=config.rollout.top_p, top_k=config.rollout.top_k, min_p=config.rollout.min_p,
                            n=samples, seed=config.run.seed)
    records = student_records(student, items, prompting, params, batch_size, progress,
                              sample_chunk=max(1, batch_size // samples), skip_self_success=config.teacher.skip_self_success)
    baseline = gap_baseline(student, teacher, gap_examples, prompting, config.eval.max_tokens, batch_size, progress)
    scores = []
    for template in tqdm(templates, desc="templates", unit="template", disable=not progress):
        score, _ = score_template(student, teacher, records, prompting.with_teacher(template), gap_examples,
                                  config.eval.max_tokens, temperature, batch_size, baseline, top_k,
                                  config.run.seed, progress)
        scores.append(score)
    settings = {
        "config_run": config.run.name, "data": config.data.spec, "student_template": config.data.student_template,
        "teacher_kind": config.teacher.kind, "teacher_model": config.teacher.weights(config.model.student),
        "prompts": prompts, "samples": samples, "gap_items": gap_items, "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p, "max_tokens": config.rollout.max_tokens, "seed": config.run.seed,
        "gap_max_tokens": config.eval.max_tokens, "top_k": top_k, "rule": RULE,
        # the rollouts' other filters, named only when on ("top_k" above is the teacher's)
        **({"sample_top_k": config.rollout.top_k} if config.rollout.top_k else {}),
        **({"min_p": config.rollout.min_p} if config.rollout.min_p else {}),
    }
    return Tournament(predicted_order(scores), settings, distinct_prompts(items), len(records),
                      sum(r.correct for r in records), distinct_prompts(gap_examples))
