"""A batch of episodes run on any engine, turn by turn in lockstep: every live episode's ids are
sampled in one call (continuations as token ids, so a vLLM server and the in-process engine see the
same thing), each reply goes to its own environment, and the environment's messages are appended
through the student's chat format without rendering the history again."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from selfopd.config.environment_target import TRL_PREFIX
from selfopd.data.example import Example
from selfopd.engines.base import Engine, SamplingParams
from selfopd.episodes.environment import BadEnvironmentAnswer, Environment, Response, RetryWithFeedback, checked_response
from selfopd.episodes.episode import Ending, Episode, Turn
from selfopd.templating.chat_format import ChatFormat

log = logging.getLogger(__name__)
SEED_STRIDE = 1_000_003  # turn t samples with seed + t * SEED_STRIDE: turns draw apart, runs repeat


@dataclass(frozen=True)
class EpisodeLimits:
    """The limits of one episode: student turns, and ids after the prompt (the student's and the
    environment's together). Each student turn's own limit is the sampling params' max_tokens."""

    max_turns: int = 3
    max_episode_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_episode_tokens < 1:
            raise ValueError("an episode has at least one turn and one token")


@dataclass
class _Live:
    prompt: tuple[int, ...]
    environment: Environment
    where: str
    turns: list[Turn] = field(default_factory=list)
    ending: Ending | None = None
    finish_reason: str = "stop"
    reward: float | None = None
    info: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [*self.prompt, *(i for t in self.turns for i in t.ids)]

    @property
    def used(self) -> int:
        return sum(len(t.ids) for t in self.turns)

    def episode(self) -> Episode:
        return Episode(self.prompt, tuple(self.turns), self.ending or "max_turns", self.finish_reason,  # type: ignore[arg-type]
                       self.reward, self.info, judged=bool(getattr(self.environment, "owns_reward", False)))


def run_episodes(engine: Engine, chat: ChatFormat, prompts: Sequence[Sequence[int]], examples: Sequence[Example],
                 make_environment: Callable[[Example], Environment], params: SamplingParams,
                 limits: EpisodeLimits = EpisodeLimits()) -> list[Episode]:
    """One episode per (prompt ids, example): a group of samples is the same prompt given again.
    An environment that raises or answers malformed ends its episode with one logged line (in
    `Episode.info['error']`); the others go on."""
    if params.n != 1:
        raise ValueError("episodes sample one reply per turn: repeat a prompt for a group")
    live = []
    for index, (prompt, example) in enumerate(zip(prompts, examples, strict=True)):
        environment = make_environment(example)
        environment.reset(example)
        live.append(_Live(tuple(prompt), environment, f"episode {index} ({example.id}), {type(environment).__name__}"))
    try:
        for turn in range(limits.max_turns):
            active = [episode for episode in live if episode.ending is None]
            if not active:
                break
            seed = None if params.seed is None else params.seed + turn * SEED_STRIDE
            sampled = engine.sample([episode.ids for episode in active], dataclasses.replace(params, seed=seed))
            for episode, (rollout,) in zip(active, sampled):
                _take_turn(episode, rollout, chat, limits, last=turn + 1 == limits.max_turns)
    finally:  # an environment that holds a connection or a process (an OpenEnv session) lets it go
        for episode in live:
            _close(episode)
    return [episode.episode() for episode in live]


def _close(episode: _Live) -> None:
    """The environment's optional `close()`; one that fails to close costs a logged line, nothing else."""
    try:
        close = getattr(episode.environment, "close", None)
        if callable(close):
            close()
    except Exception as error:
        log.warning(f"{episode.where}: close raised {type(error).__name__}: {str(error)[:200]}")


def _take_turn(episode: _Live, rollout: Any, chat: ChatFormat, limits: EpisodeLimits, last: bool) -> None:
    """The student's reply appended (cut at the episode's token limit), then the environment's answer."""
    ids, logprobs, finish = list(rollout.completion_ids), list(rollout.sampler_logprobs), rollout.finish_reason
    room = limits.max_episode_tokens - episode.used
    cut = len(ids) > room
    if cut:
        ids, logprobs, finish = ids[:room], logprobs[:room], "length"
    text = chat.tokenizer.decode(ids, skip_special_tokens=True) if cut else rollout.text
    episode.turns.append(Turn("student", tuple(ids), text, tuple(logprobs)))
    episode.finish_reason, episode.reward = finish, None  # this reply's reward is the environment's answer to it
    if cut:  # no room for more: the episode ends on a reply cut short (graded as verifier.truncated says)
        episode.ending = "max_episode_tokens"
        return
    try:
        response = checked_response(episode.environment.step(text, finish), episode.where)
    except Exception as error:  # an environment's bug or hostile answer: this episode ends, the batch goes on
        line = str(error) if isinstance(error, BadEnvironmentAnswer) else f"{episode.where}: step raised {type(error).__name__}: {str(error)[:200]}"
        log.warning(line)
        episode.ending, episode.info = "done", {"error": line}
        return
    episode.reward, episode.info = response.reward, dict(response.info)
    if response.done or last or not response.messages:
        episode.ending = "done" if response.done or not response.messages else "max_turns"
        return
    _append_environment(episode, response, chat, limits)


def _append_environment(episode: _Live, response: Response, chat: ChatFormat, limits: EpisodeLimits) -> None:
    """The environment's messages as the ids the chat format appends; an episode with no room left
    for another student token after them ends here."""
    new = chat.continuation(episode.ids, response.messages)
    if episode.used + len(new) >= limits.max_episode_tokens:
        episode.ending = "max_episode_tokens"
        return
    episode.turns.append(Turn("environment", tuple(new), chat.tokenizer.decode(new)))


@dataclass(frozen=True)
class EpisodeSampler:
    """How a run samples when its rollouts are episodes (`rollout.environment`): the student's chat
    format, an environment per episode, the limits. `sample` is `Engine.sample`'s shape: `params.n`
    episodes per prompt, as rollouts whose `loss_mask` marks the student's ids."""

    chat: ChatFormat
    make_environment: Callable[[Example], Environment]
    limits: EpisodeLimits

    def sample(self, engine: Engine, prompts: Sequence[list[int]], examples: Sequence[Example],
               params: SamplingParams) -> list[list[Any]]:
        n = params.n
        episodes = run_episodes(engine, self.chat, [p for p in prompts for _ in range(n)],
                                [e for e in examples for _ in range(n)], self.make_environment,
                                dataclasses.replace(params, n=1), self.limits)
        rollouts = [episode.rollout() for episode in episodes]
        return [rollouts[i * n : (i + 1) * n] for i in range(len(prompts))]


def episode_sampler(rollout: Any, chat: ChatFormat) -> EpisodeSampler | None:
    """The sampler `[rollout]` asks for (None: 'none', one answer per rollout)."""
    if rollout.environment == "none":
        return None
    limits = EpisodeLimits(rollout.max_turns, rollout.max_episode_tokens)
    # Whether the student's template opens a reasoning block for every reply (a thinking template's
    # `<think>`): then a reply that never closes it has no answer. The same for every turn.
    opened = chat.prompt([{"role": "user", "content": "?"}]).opens_reasoning
    if rollout.environment == "retry_feedback":
        def make(example: Example) -> Environment:
            return RetryWithFeedback(lambda reply, e, finish: chat.grade(reply, e, finish, opened), rollout.max_turns)

        return EpisodeSampler(chat, make, limits)
    if rollout.environment == "tools":  # tool calls in the student's family's own format: selfopd.episodes.tools
        from selfopd.episodes.tools import tool_environments

        return EpisodeSampler(*tool_environments(rollout, chat, opened), limits)
    if rollout.environment.startswith(TRL_PREFIX):  # a TRL environment_factory class: selfopd.episodes.trl_environment
        from selfopd.episodes.trl_environment import trl_environments

        return EpisodeSampler(*trl_environments(rollout, chat, opened), limits)
    if rollout.environment.startswith(("python:", "openenv:")):  # an OpenEnv environment: selfopd.episodes.openenv
        from selfopd.episodes.openenv import openenv_environments

        return EpisodeSampler(chat, openenv_environments(rollout.environment), limits)
    raise ValueError(f"rollout.environment {rollout.environment!r} has no environment")
