"""A rollout's verdict, the one rule training and evaluations grade by: an episode whose environment judges
(an OpenEnv environment, a TRL class with get_reward) by that environment's reward; every other rollout
by its answer's text against the reference."""

from __future__ import annotations

from selfopd.data.env_source import judged_by_environment
from selfopd.data.example import Example
from selfopd.engines.base import Rollout
from selfopd.templating.chat_format import ChatFormat
from selfopd.verifiers import VerifyResult
from selfopd.verifiers.result import quote


def grade_rollout(chat: ChatFormat, rollout: Rollout, example: Example, opened: bool,
                  partial_credit: bool = False) -> VerifyResult:
    """One rollout's verdict, in training and in evals alike: an episode whose environment is the judge (an
    OpenEnv environment, a TRL class with get_reward) by its reward for the last answer
    (`environment_reward`), as it pays it, correct at 1 or more (OpenEnv's games and TRL's examples pay 1
    for a win); with no reward (the environment never saw the last answer), or an environment's example
    (`env:` data) that no episode played, 0, unchecked. Every other rollout: the answer's text against the
    reference (`ChatFormat.grade`)."""
    if not (rollout.environment_judged or judged_by_environment(example)):
        return chat.grade(rollout.text, example, rollout.finish_reason, opened, partial_credit)
    reward = rollout.environment_reward
    if reward is None:
        return VerifyResult(0.0, False, None, None, "The environment gave no reward for this answer.", unchecked=True)
    return VerifyResult(reward, reward >= 1.0, quote(rollout.text), "environment",
                        f"The environment's reward was {reward:g}.")
