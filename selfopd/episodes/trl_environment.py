"""TRL `environment_factory` classes as tool-calling episodes (`rollout.environment = 'trl:MODULE:NAME'`).

TRL's contract (`GRPOTrainer(environment_factory=...)`, trl 1.16): a class (or function) called with no
argument makes one environment per rollout; `reset(**row)` starts its episode with the data row's columns;
every public method other than `reset` and `get_reward` is a tool, defined by its type hints and docstring;
an optional `get_reward()` scores the finished rollout from the environment's state. Here a row is the
example's fields (`prompt`, `answer`, `solution`, `hints`, then its `meta` entries); the calls run through
selfopd's tool episode (`selfopd.episodes.tools.ToolEnvironment`: the family's own call format, one line for
each bad call, at most rollout.max_tool_calls); `get_reward()`, when the class has one, is the episode's
reward after each turn and grades it (`selfopd.episodes.verdicts.grade_rollout`); else the verifier grades
the last answer against the data's reference.

One difference: TRL appends a text `reset` returns to the prompt's last user message. selfopd renders the
student's prompt and the teacher's from the data before an episode starts, so such an episode ends at its
first step with one line saying so: put that text in the data instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any, Callable

from selfopd.config.environment_target import trl_class_path
from selfopd.config.settings import ConfigError
from selfopd.data.example import Example
from selfopd.episodes.environment import Environment, Response
from selfopd.episodes.tools import ToolEnvironment, ToolError, Toolset, tool_episodes, tool_schemas

NOT_TOOLS = ("reset", "get_reward")  # TRL's: the methods that are not tools


def trl_factory(environment: str) -> Callable[[], Any]:
    """The class (or function) `trl:MODULE:NAME` names, imported; a ConfigError in one line when it
    cannot be imported or names nothing callable."""
    module_name, name = trl_class_path(environment)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigError("rollout.environment", f"{environment}: importing {module_name} failed: "
                          f"{type(error).__name__}: {' '.join(str(error).split())[:200]}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise ConfigError("rollout.environment", f"{environment}: {module_name} has no class or function {name}")
    return found


def trl_tools(instance: Any) -> dict[str, Callable[..., Any]]:
    """An environment's tools, TRL's way: the public functions of its class but `reset` and `get_reward`,
    by name, bound to it (read on the class, so a property is never evaluated)."""
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


def trl_tool_kwargs(rollout: Any) -> dict[str, Any]:
    """`tools`: the definitions of the TRL class rollout.environment names (`trl_tool_schemas`)."""
    return {"tools": list(trl_tool_schemas(rollout.environment))}


@functools.lru_cache(maxsize=8)
def trl_tool_schemas(environment: str) -> tuple[Any, ...]:
    """The tools' definitions every prompt of a run shows (the student's, each teacher's, the eval's): from
    one environment made for that, as TRL probes one. A ConfigError in one line when it cannot be made,
    has no reset, or a tool cannot be defined (no docstring, an argument without a type hint)."""
    probe = _made(trl_factory(environment), environment)
    try:
        schemas = tool_schemas(trl_tools(probe))
    except ToolError as error:
        raise ConfigError("rollout.environment", f"{environment}: {error}") from None
    if not schemas:
        raise ConfigError("rollout.environment", f"{environment}: {type(probe).__name__} has no public method "
                          "besides reset and get_reward, so the student has no tool")
    return tuple(schemas)


def _made(factory: Callable[[], Any], environment: str) -> Any:
    try:
        instance = factory()
    except Exception as error:
        raise ConfigError("rollout.environment", f"{environment}: making it raised {type(error).__name__}: "
                          f"{' '.join(str(error).split())[:200]}") from None
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError("rollout.environment", f"{environment}: made a {type(instance).__name__}, which has no "
                          "reset(**row)")
    return instance


def row_of(example: Example) -> dict[str, Any]:
    """What `reset(**row)` gets: the example's fields, as a dataset row's columns."""
    return {**example.meta, "prompt": example.prompt, "answer": example.answer, "solution": example.solution,
            "hints": list(example.hints)}


class TrlEpisode:
    """One episode's TRL environment, as selfopd's `Environment`: a tool episode over its methods, rewarded
    by its `get_reward()` when it has one (`owns_reward`)."""

    def __init__(self, environment: str, factory: Callable[[], Any],
                 tool_episode: Callable[[dict[str, Callable[..., Any]]], ToolEnvironment]) -> None:
        self.environment, self.factory, self.tool_episode = environment, factory, tool_episode
        self.instance: Any = None
        self.inner: ToolEnvironment | None = None
        self.failure: str | None = None

    @property
    def owns_reward(self) -> bool:
        return callable(getattr(self.instance, "get_reward", None))

    def reset(self, example: Example) -> None:
        """A new environment, reset with the example's row; a failure is kept for the first step, so the
        student's first reply is kept like any other."""
        self.failure = None
        try:
            self.instance = self.factory()
            observation = self.instance.reset(**row_of(example))
        except Exception as error:
            self.failure = f"{self.environment}: reset raised {type(error).__name__}: {' '.join(str(error).split())[:200]}"
            return
        if observation is not None:
            self.failure = (f"{self.environment}: reset returned an observation ({str(observation)[:60]!r}...), which TRL "
                            "appends to the prompt; selfopd renders the student's and the teacher's prompts from the "
                            "data before the episode: put that text in the data's prompt and return None")
            return
        self.inner = self.tool_episode(trl_tools(self.instance))
        self.inner.reset(example)

    def step(self, reply: str, finish_reason: str) -> Response:
        if self.failure is not None or self.inner is None:
            raise RuntimeError(self.failure or f"{self.environment}: step before reset")
        response = self.inner.step(reply, finish_reason)
        if not self.owns_reward:
            return response
        reward = self.instance.get_reward()  # checked finite by `checked_response`, as every environment's
        return dataclasses.replace(response, reward=reward)


def trl_environments(rollout: Any, chat: Any, opened: bool) -> tuple[Any, Callable[[Example], Environment]]:
    """For `episode_sampler`, with rollout.environment = 'trl:MODULE:NAME': the student's chat format showing
    the class's tools, and a `TrlEpisode` per episode (`tool_episodes`, over its own instance's methods).
    What cannot work (an import, a tool without a definition, a template without tools) is refused here in
    one line, before anything is sampled."""
    chat, call_format, episode = tool_episodes(rollout, chat, opened, trl_tool_kwargs(rollout))
    factory = trl_factory(rollout.environment)

    def make(example: Example) -> Environment:
        return TrlEpisode(rollout.environment, factory, lambda methods: episode(Toolset(methods, call_format)))

    return chat, make
