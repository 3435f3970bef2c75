"""A step's verdicts and teacher prompts: each rollout is verified, then the teacher's prompt
is rendered around the student's exact completion (with a correct sibling's text for a
template that uses `demonstration`), and with `loss.opd_baseline = "wrong_context"` a second
prompt that gives the same template a wrong context (`selfopd.templating.wrong_context`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from selfopd.templating.demonstrations import pick_demonstrations
from selfopd.data.example import Example
from selfopd.templating.templates import prompt_token_ids, render_teacher
from selfopd.verifiers import verify_example
from selfopd.templating.wrong_context import failed_sibling_answers, wrong_example


@dataclass(frozen=True)
class TeacherRow:
    """One rollout, its verdict and what the teacher is shown."""

    example: Example
    group: int
    rollout: Any  # engines.base.Rollout
    verdict: Any  # verifiers.VerifyResult
    prompt_ids: list[int]
    demonstration: str | None
    wrong_prompt_ids: list[int] | None  # the wrong-context prompt, when the loss contrasts with one


def teacher_rows(run: Any, examples: Sequence[Example], student_messages: Sequence[Any], groups: Sequence[Any],
                 first_group: int) -> list[TeacherRow]:
    """The rows of this rank's prompt groups, in order (group `first_group` first)."""
    cfg = run.config
    contrastive = cfg.loss.opd_baseline == "wrong_context"
    # Feedback against the wrong answer only where a template shows feedback (verifying costs time).
    shows_feedback = any("feedback" in t.variables for t in (run.teacher_template, run.demonstration_fallback) if t)
    rows = []
    for group, (example, messages, rollouts) in enumerate(zip(examples, student_messages, groups), first_group):
        verdicts = [verify_example(r.text, example, partial_credit=cfg.loss.partial_credit) for r in rollouts]
        correct = [v.correct for v in verdicts]
        demonstrations = (pick_demonstrations([r.text for r in rollouts], correct, seed=cfg.run.seed, step=run.step,
                                              group=group, skip_self=cfg.teacher.skip_self_success)
                          if run.demonstration_fallback is not None else [None] * len(rollouts))
        wrong_answers = (failed_sibling_answers([v.extracted for v in verdicts], correct, seed=cfg.run.seed,
                                                step=run.step, group=group) if contrastive else [None] * len(rollouts))
        other = examples[(group - first_group + 1) % len(examples)]  # another prompt's solution and hints
        for rollout, verdict, demonstration, wrong_answer in zip(rollouts, verdicts, demonstrations, wrong_answers):
            def prompt(shown: Example, feedback: str) -> list[int]:
                return prompt_token_ids(run.tokenizer, render_teacher(
                    run.teacher_template, shown, messages, rollout.text, feedback, demonstration,
                    run.demonstration_fallback))

            wrong = wrong_example(example, other, seed=cfg.run.seed, answer=wrong_answer) if contrastive else None
            wrong_ids = None
            if wrong is not None:  # verifier feedback, too, as if the wrong answer were the reference
                wrong_ids = prompt(wrong, verify_example(rollout.text, wrong).feedback if shows_feedback
                                   else verdict.feedback)
            rows.append(TeacherRow(example, group, rollout, verdict, prompt(example, verdict.feedback), demonstration,
                                   wrong_ids))
    return rows
