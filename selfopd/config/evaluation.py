"""The `[eval]` section of a training config: what the in-run eval and `selfopd eval` sample, the
prompt they render and how they grade it. Part of `selfopd.config`, which re-exports it.

Its prompt and grading settings default to training's ('' and {}: the student's template, chat-template
arguments and [verifier]); a source that evaluates differently from how it trains (OPSD, nanopd) is
matched by setting them. `template`, `template_kwargs` and `grading` are the one place that decision
is made (`selfopd.run.evaluate.eval_prompting` reads them for both evals)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Mapping

from selfopd.config.compute import check_template_kwargs
from selfopd.config.settings import (MAX_BATCH, MAX_SAMPLES, MAX_TEMPERATURE, MAX_TOKENS, Section, TableValue,
                                     check_printable, fail, setting)
from selfopd.config.verifier import VerifierConfig

if TYPE_CHECKING:
    from selfopd.config import RolloutConfig

EvalTruncated = Literal["", "wrong", "grade"]
EvalReasoning = Literal["", "graded"]
EvalEnvironment = Literal["", "none"]


@dataclass(frozen=True)
class EvalConfig(Section):
    SECTION: ClassVar[str] = "eval"
    max_tokens: int = setting(48, "Most completion tokens per eval answer.", ge=1, most=MAX_TOKENS)
    batch_size: int = setting(32, "Prompts per eval generation batch.", ge=1, most=MAX_BATCH)
    data: str = setting(
        "", "Data spec of the in-run eval ('': the run's held-out split of data.spec); refused when it holds a prompt "
        "the run trains on.", guarded="it decides what data is generated, downloaded or read")
    samples: int = setting(
        1, "Answers per eval prompt, k: the eval reports avg@k and the unbiased pass@k (1: one answer each).", ge=1,
        most=MAX_SAMPLES)
    temperature: float = setting(0.0, "Eval sampling temperature (0: greedy; samples > 1 needs > 0).", ge=0.0,
                                 most=MAX_TEMPERATURE)
    top_p: float = setting(1.0, "Eval nucleus sampling mass, in (0, 1] (1: off).", gt=0, le=1)
    top_k: int = setting(0, "Eval top-k sampling: the k most likely tokens (0: off).", ge=0, most=MAX_TOKENS)
    min_p: float = setting(0.0, "Eval min-p sampling: drop tokens below min_p x the top token's probability (0: off).",
                           ge=0.0, le=1)
    student_template: str = setting(
        "", "Prompt template the eval renders ('': data.student_template, the one training renders). For a source "
        "that evaluates on another prompt than it trains on: OPSD trains on student/opsd and evaluates on "
        "student/opsd_eval; nanopd trains on student/plain and evaluates on student/step_by_step_boxed. "
        "docs/evaluation.md")
    chat_template_kwargs: dict[str, TableValue] = setting(
        {}, "Chat-template arguments of the eval's prompts, merged over model.chat_template_kwargs: empty (the "
        "default) prompts as training does; a name set here overrides the student's value for the eval only (e.g. "
        "{enable_thinking = true}: OPSD trains without thinking and evaluates with it).")
    truncated: EvalTruncated = setting(
        "", "An eval answer stopped at eval.max_tokens: '' as verifier.truncated; 'wrong' (scored 0, not read) or "
        "'grade' (graded like a finished one, as nanopd's and OPSD's evals do).")
    reasoning: EvalReasoning = setting(
        "", "What of an eval answer is graded: '' as training's rewards read it (the text after the reasoning block "
        "of verifier.reasoning_start / reasoning_end; an unclosed block has no answer); 'graded': the whole "
        "completion, reasoning block included, so the last answer anywhere counts (OPSD's eval takes the last "
        "\\boxed{} of the whole output, thinking included).")
    environment: EvalEnvironment = setting(
        "", "Episodes in the eval: '' as training's rollout.environment (each answer an episode under the same "
        "environment, tools and limits, eval.max_tokens a turn; an `env:` example graded by its environment's "
        "reward); 'none': one answer per prompt, without tools (a retry task's first try).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_printable(self._key("data"), self.data, allow="")
        check_printable(self._key("student_template"), self.student_template, allow="")
        check_template_kwargs(self._key("chat_template_kwargs"), self.chat_template_kwargs)
        if self.samples > 1 and self.temperature == 0:
            fail(self._key("samples"),
                 f"{self.samples} samples a prompt need eval.temperature > 0: greedy answers are identical")

    def template(self, student_template: str) -> str:
        """The template the eval renders: eval.student_template, else `student_template` (data.student_template)."""
        return self.student_template or student_template

    def template_kwargs(self, student: Mapping[str, TableValue]) -> dict[str, TableValue]:
        """The eval's chat-template arguments: eval.chat_template_kwargs over `student` (model.chat_template_kwargs)."""
        return {**student, **self.chat_template_kwargs}

    def episodes(self, rollout: RolloutConfig) -> RolloutConfig:
        """The [rollout] whose environment the eval's answers run in: `rollout` (training's), or with
        eval.environment = 'none' the same with no environment (one answer per prompt)."""
        return dataclasses.replace(rollout, environment="none") if self.environment == "none" else rollout

    def grading(self, verifier: VerifierConfig) -> VerifierConfig:
        """The [verifier] settings the eval grades with: `verifier`'s, with eval.truncated when it is set, and with
        no reasoning blocks (the whole completion read) when eval.reasoning = 'graded'."""
        graded = {"reasoning_start": "", "reasoning_end": ""} if self.reasoning == "graded" else {}
        return dataclasses.replace(verifier, truncated=self.truncated or verifier.truncated, **graded)
