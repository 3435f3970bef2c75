"""One episode as the trainer sees it: the prompt, then turns whose ids are exactly what the engine
was given and returned, flattened into one `Rollout` whose `loss_mask` marks the student's ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from selfopd.engines.base import Rollout

Role = Literal["student", "environment"]
# How an episode ended: the environment said done (or had nothing to say); the turn limit; the
# episode's token limit. A student turn cut at its max_tokens goes to the environment like any other
# (`finish_reason` "length"); the episode's `finish_reason` is its last student turn's.
Ending = Literal["done", "max_turns", "max_episode_tokens"]


@dataclass(frozen=True)
class Turn:
    """One turn's ids: the student's as sampled (with the sampler's logprobs), or the environment's
    as rendered by the student's chat format (what closes the student's turn, the new messages, the
    next generation prompt)."""

    role: Role
    ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()  # the student's turns only: the sampler's, one per id


@dataclass(frozen=True)
class Episode:
    """A whole episode: `prompt_ids` (the first prompt, as tokenized) and its turns in order."""

    prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    ending: Ending
    finish_reason: Literal["stop", "length"]  # the last student turn's
    # The environment's reward for the student's last turn; None when it gave none or never saw that turn
    # (cut at the episode's token limit, or its step failed): an earlier turn's reward is not the answer's.
    reward: float | None = None
    info: dict = field(default_factory=dict)  # the environment's last metadata (pass counts, ...)
    # The environment's reward is the verdict (it `owns_reward`: an OpenEnv environment, a TRL class with
    # get_reward); else the verifier grades the last answer and `reward` is information only.
    judged: bool = False

    @property
    def ids(self) -> list[int]:
        """Every id of the episode: the prompt, then each turn's."""
        return [*self.prompt_ids, *(i for turn in self.turns for i in turn.ids)]

    @property
    def student_text(self) -> str:
        """The student's last turn: what is graded as its answer."""
        return next((t.text for t in reversed(self.turns) if t.role == "student"), "")

    def rollout(self, weight_version: int | None = None) -> Rollout:
        """The episode as one rollout: the completion is every id after the prompt, the environment's
        ids masked out of the loss (sampler logprob 0: never read for them)."""
        completion, logprobs, mask = [], [], []
        for turn in self.turns:
            completion += turn.ids
            own = turn.role == "student"
            logprobs += turn.logprobs if own else [0.0] * len(turn.ids)
            mask += [own] * len(turn.ids)
        return Rollout(list(self.prompt_ids), completion, logprobs, self.finish_reason, self.student_text,
                       weight_version=weight_version, loss_mask=tuple(mask),
                       environment_judged=self.judged, environment_reward=self.reward if self.judged else None)
