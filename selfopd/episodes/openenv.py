"""OpenEnv environments as episode environments (`rollout.environment = 'python:MODULE:NAME'` or
`'openenv:URL'`).

Each episode opens its own session (a new environment instance, or a new WebSocket and so a new
environment on the server), resets it with its example's seed (`selfopd.data.env_source`) and checks
that the opening observation is the example's prompt: the prompt the student and the teacher were
given. Each student reply becomes the environment's action and each observation a user message
(`selfopd.data.openenv_session` holds both rules); done and reward pass through, the observation's
metadata goes into the episode's info. A failure at reset is reported at the first step, so the
student's first reply is kept like any other; every failure ends its episode in one line, and the
session is closed as soon as the episode ends.
"""

from __future__ import annotations

from typing import Callable

from selfopd.config.environment_target import parse_environment_target
from selfopd.config.settings import ConfigError
from selfopd.data.env_source import META_SEED
from selfopd.data.example import Example
from selfopd.data.openenv_session import EnvironmentFailure, InProcess, Remote, Timeouts, connect
from selfopd.episodes.environment import Environment, Response


class OpenEnvEpisode:
    """One episode's session of an OpenEnv environment, as selfopd's `Environment`; its reward is the verdict."""

    owns_reward = True

    def __init__(self, connector: InProcess | Remote) -> None:
        self.connector = connector
        self.session = None
        self.failure: str | None = None

    def reset(self, example: Example) -> None:
        seed = example.meta.get(META_SEED)
        if not isinstance(seed, int) or isinstance(seed, bool):
            self.failure = (f"{self.connector.who}: the example has no environment seed: its data is not this "
                            "environment's opening observations (data.spec = 'env:' + rollout.environment)")
            return
        try:
            self.session = self.connector.open()
            opening = self.session.reset(seed)
        except EnvironmentFailure as error:
            self.failure = str(error)
            self.close()
            return
        if opening.text != example.prompt:
            self.failure = (f"{self.connector.who}: not deterministic: reset with seed {seed} gave another opening "
                            "observation than the example's prompt (or the environment changed since the data was built)")
        elif opening.done:
            self.failure = f"{self.connector.who}: reset with seed {seed} gave a finished episode"

    def step(self, reply: str, finish_reason: str) -> Response:
        if self.failure is not None or self.session is None:
            self.close()
            raise EnvironmentFailure(self.failure or f"{self.connector.who}: step before reset")
        try:
            observed = self.session.step(reply)
        except EnvironmentFailure:
            self.close()
            raise
        if observed.done:
            self.close()
        message = {"role": "user", "content": observed.text}
        return Response((message,), observed.done, observed.reward, dict(observed.metadata))

    def close(self) -> None:
        """The session let go (an environment instance closed, a server's session ended); safe twice."""
        session, self.session = self.session, None
        if session is not None:
            session.close()


def openenv_environments(environment: str, timeouts: Timeouts = Timeouts()) -> Callable[[Example], Environment]:
    """`make_environment` for `rollout.environment` = a target: the class imported (or the server's action
    schema read) once, here, so that a target that cannot work stops the run before it samples."""
    try:
        connector = connect(parse_environment_target(environment), timeouts)
    except (ValueError, EnvironmentFailure) as error:
        raise ConfigError("rollout.environment", str(error)) from None
    return lambda example: OpenEnvEpisode(connector)
