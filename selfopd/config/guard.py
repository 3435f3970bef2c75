"""The `[guard]` section of a training config: when the illusion guard (`selfopd.training.guard`)
fires. Part of `selfopd.config`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from selfopd.config.settings import MAX_STEPS, MAX_WEIGHT, Section, setting

GuardAction = Literal["off", "warn", "stop"]


@dataclass(frozen=True)
class GuardConfig(Section):
    """The illusion guard (`selfopd.training.guard`): conditions over the last `window` training steps,
    each compared between the window's first and second half. Calibration:
    docs/results/illusion.md, "The illusion guard on real runs"."""

    SECTION: ClassVar[str] = "guard"
    action: GuardAction = setting(
        "warn", "What a firing condition does while the teacher term is trained on (loss.lambda_opd > 0): 'warn' "
        "(one line, then go on), 'stop' (end the run), 'off'. Either way its step is checkpointed and "
        "RUN/guard.json and RUN/guard.md say why.")
    window: int = setting(6, "Steps the conditions look back over; its first and second halves are compared.", ge=2,
                          most=MAX_STEPS)
    kl_drop: float = setting(
        0.1, "KL and accuracy fall: the mean opd/reverse_kl of the window's second half is at least this much "
        "below its first half's...", ge=0.0, most=MAX_WEIGHT)
    accuracy_drop: float = setting(
        0.05, "... while the mean reward/accuracy (training samples) is at least this much below too.", ge=0.0, le=1)
    truncated_share: float = setting(
        0.5, "Length cap: the mean rollout/truncated_share of the window's second half is at least this...", ge=0, le=1)
    truncated_rise: float = setting(
        0.1, "... and at least this much above its first half's (a share that starts high and falls is healthy)...",
        ge=0.0, le=1)
    truncated_z: float = setting(
        1.645, "... and the rise stands out of the noise: the difference over its standard error is at least this, "
        "with the prompts of each half as the units (a prompt's samples share its length; 1.645: one-sided 95%; "
        "0: no test). Without it a share hovering at 0.5-0.7 fires on its own noise.", ge=0.0, most=MAX_WEIGHT)
    preference_max: float = setting(
        0.0, "Teacher prefers wrong: the 95% upper bound of the teacher-prefers-correct measure pooled over the "
        "window's prompt groups (opd/correct_preference_*) is at or below this...", ge=-MAX_WEIGHT, most=MAX_WEIGHT)
    preference_groups: int = setting(8, "... over at least this many prompt groups with both right and wrong samples.",
                                     ge=2, most=MAX_STEPS)
    starved_teacher_steps: int = setting(
        5, "With [teachers.*]: print a warning when a teacher has received no completion tokens for this many steps in "
        "a row (0: never). A starved teacher logs no advantage or KL: its metrics fall silent rather than look bad.",
        ge=0, most=MAX_STEPS)
