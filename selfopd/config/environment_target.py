"""`rollout.environment` names an environment of its own: which strings do, checked when the config
loads (nothing is imported or contacted here; `selfopd.data.openenv_session` does that when a run starts).

    python:MODULE:NAME   an OpenEnv `Environment` subclass (or a function returning an instance), in this process
    openenv:URL          an OpenEnv server, reached over its WebSocket (ws://, wss://, http:// or https://)
    trl:MODULE:NAME      a TRL `environment_factory` class: tools as its methods (`selfopd.episodes.trl_environment`)

An OpenEnv environment's prompts are its opening observations: `data.spec = "env:" + rollout.environment`.
The built-in environments and a TRL class start from the data's own prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

# rollout.environment values that are not a target (selfopd.episodes.sampling.episode_sampler knows each).
BUILTIN_ENVIRONMENTS = ("none", "retry_feedback", "tools")
TRL_PREFIX = "trl:"  # a TRL environment_factory class, MODULE:NAME after it
ENV_DATA_PREFIX = "env:"  # a data spec whose examples are an environment's opening observations
MIXTURE_SEPARATOR = " + "  # selfopd.data.mixture.SEPARATOR (the data package comes after config)
URL_SCHEMES = ("ws", "wss", "http", "https")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class EnvironmentTarget:
    """Where an environment lives: `python` (`where` = MODULE:NAME) or `openenv` (`where` = the server URL)."""

    kind: Literal["python", "openenv"]
    where: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.where}"

    @property
    def module_and_name(self) -> tuple[str, str]:
        module, _, name = self.where.rpartition(":")
        return module, name


def trl_class_path(text: str) -> tuple[str, str]:
    """(MODULE, NAME) of `trl:MODULE:NAME`; a ValueError saying what is wrong otherwise."""
    module, _, name = text.strip()[len(TRL_PREFIX):].rpartition(":")
    if not text.strip().startswith(TRL_PREFIX) or not _DOTTED.fullmatch(module) or not _NAME.fullmatch(name):
        raise ValueError(f"{text!r}: expected trl:MODULE:NAME, e.g. trl:my_envs.wordle:WordleEnv")
    return module, name


def check_environment(text: str) -> None:
    """A ValueError saying what is wrong when `text` names no environment (rollout.environment)."""
    if text in BUILTIN_ENVIRONMENTS:
        return
    if text.strip().startswith(TRL_PREFIX):
        trl_class_path(text)
    else:
        parse_environment_target(text)


def parse_environment_target(text: str) -> EnvironmentTarget:
    """The target `text` names; a ValueError saying what is wrong with it otherwise."""
    kind, colon, where = text.strip().partition(":")
    if not colon or kind not in ("python", "openenv"):
        raise ValueError(f"{text!r} is not an environment: expected one of {', '.join(map(repr, BUILTIN_ENVIRONMENTS))}, "
                         "'python:MODULE:NAME' (an OpenEnv Environment class in this process), 'openenv:URL' (an "
                         "OpenEnv server, ws://HOST:PORT) or 'trl:MODULE:NAME' (a TRL environment_factory class)")
    if kind == "python":
        module, _, name = where.rpartition(":")
        if not _DOTTED.fullmatch(module) or not _NAME.fullmatch(name):
            raise ValueError(f"{text!r}: expected python:MODULE:NAME, e.g. python:my_envs.guess:GuessNumber")
        return EnvironmentTarget("python", where)
    return EnvironmentTarget("openenv", _checked_url(text, where))


def _checked_url(text: str, url: str) -> str:
    """An OpenEnv server's base URL (the client adds /ws itself): a host, no credentials, query or fragment."""
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number raises here
    except ValueError as error:
        raise ValueError(f"{text!r}: not a URL ({error})") from None
    if parts.scheme not in URL_SCHEMES or not parts.hostname:
        raise ValueError(f"{text!r}: expected openenv:ws://HOST:PORT (or wss://, http://, https://)")
    if parts.username or parts.password:
        raise ValueError("the URL holds credentials (USER:PASSWORD@; not shown here): a config shows them in every "
                         "log and run folder, and OpenEnv's client sends none; name the server by host and port")
    if parts.query or parts.fragment or (port is not None and not 0 < port < 65536):
        raise ValueError(f"{text!r}: expected the server's base URL, without a query or fragment (the client adds "
                         "/ws itself)")
    return url.rstrip("/")


def environment_data_problem(environment: str, data_spec: str, data_key: str = "data.spec") -> tuple[str, str] | None:
    """(key, why) when `rollout.environment` and `data_spec` (the setting `data_key`: data.spec, or eval.data)
    do not name one environment; None when they do. An environment's episodes start from its own opening
    observations, which only its `env:` data builds."""
    parts = [part.strip() for part in data_spec.split(MIXTURE_SEPARATOR)]
    if environment in BUILTIN_ENVIRONMENTS or environment.strip().startswith(TRL_PREFIX):
        named = [part for part in parts if part.startswith(ENV_DATA_PREFIX)]
        if named:
            return ("rollout.environment", f"{environment!r}, and data.spec names an environment ({named[0]!r}) "
                    f"whose prompts are its opening observations: set rollout.environment = "
                    f"{named[0][len(ENV_DATA_PREFIX):].partition('?')[0]!r}")
        return None
    target = parse_environment_target(environment)
    for part in parts:
        head = part.partition("?")[0]
        if not (head.startswith(ENV_DATA_PREFIX) and _same_target(head[len(ENV_DATA_PREFIX):], target)):
            return (data_key, f"{part!r} with rollout.environment = {environment!r}: each episode starts from the "
                    f"environment's opening observation for a seed, which its own data spec builds: use {data_key} = "
                    f"'{ENV_DATA_PREFIX}{target}?size=N&seed=S'")
    return None


def _same_target(text: str, target: EnvironmentTarget) -> bool:
    try:
        return parse_environment_target(text) == target
    except ValueError:
        return False
