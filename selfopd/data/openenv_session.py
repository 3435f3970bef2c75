"""An OpenEnv environment as selfopd talks to it: in this process (`python:MODULE:NAME`, an `Environment`
subclass or a function returning one) or on a server (`openenv:URL`, through OpenEnv's own WebSocket
client), one session per episode, speaking text both ways.

The two rules that turn text into the environment's types live here, once, for the data source that
builds prompts from opening observations (`selfopd.data.env_source`) and for the episodes
(`selfopd.episodes.openenv`):

- a reply becomes the action: the action model's one string field (besides OpenEnv's `metadata`); a model
  with several string fields, none, or other required fields is refused in one line;
- an observation becomes text: its one string field (besides `done`, `reward`, `metadata`), or several
  as `name: value` paragraphs in the model's order; undecodable characters replaced, cut at
  MAX_OBSERVATION_CHARS.

Whatever an environment returns is untrusted: every failure (an exception, a malformed answer, a server
that is gone, hangs or sends too much) is an `EnvironmentFailure` of one line naming the environment.
A server's waits are bounded (`Timeouts`); an environment in this process is trusted code and is not.
OpenEnv's server does not send an observation's `metadata`, so a remote session's is always empty.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import typing
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from selfopd.config.compute import is_loopback
from selfopd.config.environment_target import EnvironmentTarget

MAX_OBSERVATION_CHARS = 16_000  # an observation's text past this is cut, and says so
MAX_SCHEMA_BYTES = 2**20
STANDARD_FIELDS = ("done", "reward", "metadata")  # OpenEnv's Observation fields: never the text
MAX_METADATA_ITEMS, MAX_METADATA_CHARS = 64, 1000
INSTALL = "pip install 'selfopd[envs]' (or without gradio, as make setup does: docs/episodes.md)"


class EnvironmentFailure(RuntimeError):
    """An environment that failed or answered something unusable: one line naming it and what happened."""


@dataclass(frozen=True)
class Timeouts:
    """A server's bounded waits: to connect (and read its schema), for each answer; the largest message taken."""

    connect_s: float = 10.0
    answer_s: float = 60.0
    max_message_bytes: int = 4 * 2**20


@dataclass(frozen=True)
class Observed:
    """One observation as text, with OpenEnv's standard fields."""

    text: str
    done: bool = False
    reward: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def one_line(text: Any, limit: int = 300) -> str:
    """`text` on one line, at most `limit` characters: how an environment's own words enter a message."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + " [...]"


def connect(target: EnvironmentTarget, timeouts: Timeouts = Timeouts()) -> InProcess | Remote:
    """What opens sessions of `target`: the class imported (one instance made to read its action model) or
    the server's action schema read; an `EnvironmentFailure` when that cannot be done."""
    return InProcess(target) if target.kind == "python" else Remote(target, timeouts)


# --------------------------------------------------------------------------- the text rules

def action_field(schema: Any, who: str) -> str:
    """The action model's field that takes the reply (from its JSON schema, in process or a server's)."""
    if not isinstance(schema, Mapping) or not isinstance(schema.get("properties"), Mapping):
        raise EnvironmentFailure(f"{who}: its action schema is not an object schema")
    properties = {name: spec for name, spec in schema["properties"].items() if name != "metadata"}
    texts = [name for name, spec in properties.items() if _is_string(spec)]
    if len(texts) != 1:
        raise EnvironmentFailure(f"{who}: its action model has {len(texts)} string fields ({', '.join(texts) or 'none'}; "
                                 f"all fields: {', '.join(map(str, properties)) or 'none'}); the reply is sent as the "
                                 "one string field of an action model")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    others = [str(name) for name in required if name not in ("metadata", texts[0])]
    if others:
        raise EnvironmentFailure(f"{who}: its action model also requires {', '.join(others)}, which a reply cannot "
                                 "fill; give them defaults")
    return texts[0]


def _is_string(spec: Any) -> bool:
    """A JSON-schema property that holds a string (`str`, or `str | None`)."""
    if not isinstance(spec, Mapping):
        return False
    options = spec.get("anyOf") if isinstance(spec.get("anyOf"), list) else [spec]
    return any(isinstance(option, Mapping) and option.get("type") == "string" for option in options)


def observation_text(fields: Any, who: str) -> str:
    """An observation's fields (the standard ones left out) as the text the student reads."""
    if not isinstance(fields, Mapping):
        raise EnvironmentFailure(f"{who}: the observation is {type(fields).__name__}, not an object")
    texts = [(str(name), value) for name, value in fields.items() if name not in STANDARD_FIELDS and isinstance(value, str)]
    if not texts:
        raise EnvironmentFailure(f"{who}: the observation has no string field to show (fields: "
                                 f"{one_line(', '.join(map(str, fields)) or 'none', 120)})")
    text = texts[0][1] if len(texts) == 1 else "\n\n".join(f"{name}: {value}" for name, value in texts)
    text = text.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates become '?'
    if len(text) > MAX_OBSERVATION_CHARS:
        text = f"{text[:MAX_OBSERVATION_CHARS]}\n[... {len(text) - MAX_OBSERVATION_CHARS:,} more characters cut]"
    return text


def observed(fields: Any, done: Any, reward: Any, metadata: Any, who: str) -> Observed:
    """An answer's parts checked: text by `observation_text`, done a bool, reward a finite number or None."""
    if not isinstance(done, bool):
        raise EnvironmentFailure(f"{who}: done is {one_line(repr(done), 40)}, not true or false")
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        raise EnvironmentFailure(f"{who}: reward {one_line(repr(reward), 40)} is not a finite number")
    return Observed(observation_text(fields, who), done, None if reward is None else float(reward),
                    _bounded_metadata(metadata))


def _bounded_metadata(metadata: Any) -> dict[str, Any]:
    """An observation's metadata as plain, bounded values (it goes into an episode's info)."""
    if not isinstance(metadata, Mapping):
        return {}
    kept = {}
    for name, value in list(metadata.items())[:MAX_METADATA_ITEMS]:
        plain = value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)
        kept[one_line(name, 80)] = plain[:MAX_METADATA_CHARS] if isinstance(plain, str) else plain
    return kept


# --------------------------------------------------------------------------- in this process

class InProcess:
    """Sessions of an environment class (or factory) imported from the config's MODULE:NAME."""

    def __init__(self, target: EnvironmentTarget) -> None:
        self.target, self.who = target, str(target)
        self.factory = _imported(target)
        probe = self.make()
        try:
            self.action_model = _action_model(probe, self.who)
            self.field = action_field(self.action_model.model_json_schema(), self.who)
        finally:
            _close_quietly(probe)

    def make(self) -> Any:
        environment = _call(self.who, "making it", self.factory)
        if _looks_like_trl(type(environment)):
            raise EnvironmentFailure(_trl_message(self.who))
        if not (callable(getattr(environment, "reset", None)) and callable(getattr(environment, "step", None))):
            raise EnvironmentFailure(f"{self.who}: made a {type(environment).__name__}, which has no reset and step")
        return environment

    def open(self) -> InProcessSession:
        return InProcessSession(self, self.make())


class InProcessSession:
    def __init__(self, connector: InProcess, environment: Any) -> None:
        self.connector, self.environment, self.who = connector, environment, connector.who

    def reset(self, seed: int) -> Observed:
        return self._observed(_call(self.who, "reset", lambda: self.environment.reset(seed=seed)))

    def step(self, text: str) -> Observed:
        action = _call(self.who, "building its action", lambda: self.connector.action_model.model_validate(
            {self.connector.field: text}))
        return self._observed(_call(self.who, "step", lambda: self.environment.step(action)))

    def close(self) -> None:
        _close_quietly(self.environment)

    def _observed(self, observation: Any) -> Observed:
        if not callable(getattr(observation, "model_dump", None)):
            raise EnvironmentFailure(f"{self.who}: returned {type(observation).__name__}, not an OpenEnv Observation")
        try:  # as OpenEnv's server would send it, so that a remote session reads the same text
            fields = observation.model_dump(mode="json", exclude=set(STANDARD_FIELDS))
        except Exception:
            fields = _call(self.who, "model_dump", lambda: observation.model_dump(exclude=set(STANDARD_FIELDS)))
        return observed(fields, getattr(observation, "done", False), getattr(observation, "reward", None),
                        getattr(observation, "metadata", {}), self.who)


def _imported(target: EnvironmentTarget) -> Callable[[], Any]:
    module_name, name = target.module_and_name
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        hint = f"; {INSTALL}" if isinstance(error, ModuleNotFoundError) and error.name == "openenv" else (
            "; is it installed, or on PYTHONPATH?" if isinstance(error, ModuleNotFoundError) else "")
        raise EnvironmentFailure(f"{target}: importing {module_name} failed: {type(error).__name__}: "
                                 f"{one_line(error)}{hint}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise EnvironmentFailure(f"{target}: {module_name} has no class or function {name}")
    if inspect.isclass(found) and _looks_like_trl(found):
        raise EnvironmentFailure(_trl_message(str(target)))
    return found


def _looks_like_trl(cls: type) -> bool:
    """TRL's environment_factory shape: reset(**row) and tools as public methods, no OpenEnv step."""
    return callable(getattr(cls, "reset", None)) and not callable(getattr(cls, "step", None))


def _trl_message(who: str) -> str:
    return (f"{who} is a TRL environment_factory class (reset(**row), its public methods tools, no step): it "
            f"answers tool calls, not replies; name it rollout.environment = 'trl:{who.partition(':')[2]}' on the "
            "data's own prompts (docs/episodes.md)")


def _action_model(environment: Any, who: str) -> Any:
    """The pydantic model `step` takes: its annotation, else Environment[Action, ...]'s first argument."""
    from pydantic import BaseModel

    step = type(environment).step
    candidates = []
    try:
        first = list(inspect.signature(step).parameters)[1]
        candidates.append(typing.get_type_hints(step).get(first))
    except (IndexError, NameError, TypeError, ValueError):
        pass
    for base in getattr(type(environment), "__orig_bases__", ()):
        candidates += list(typing.get_args(base))[:1]
    for candidate in candidates:
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    raise EnvironmentFailure(f"{who}: cannot tell which Action model step takes: annotate it (def step(self, action: "
                             "MyAction, ...)) or subclass Environment[MyAction, MyObservation, State]")


def _call(who: str, what: str, function: Callable[[], Any]) -> Any:
    try:
        return function()
    except EnvironmentFailure:
        raise
    except Exception as error:  # the environment's own bug: one line, the caller decides what it ends
        raise EnvironmentFailure(f"{who}: {what} raised {type(error).__name__}: {one_line(error)}") from None


def _close_quietly(thing: Any) -> None:
    try:
        close = getattr(thing, "close", None)
        if callable(close):
            close()
    except Exception:  # closing is best effort: the episode's result is already kept
        pass


# --------------------------------------------------------------------------- on a server

class Remote:
    """Sessions on an OpenEnv server: one WebSocket (one environment on the server) per session."""

    def __init__(self, target: EnvironmentTarget, timeouts: Timeouts) -> None:
        self.target, self.who, self.timeouts = target, str(target), timeouts
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ModuleNotFoundError:
            raise EnvironmentFailure(f"{self.who}: OpenEnv is not installed; {INSTALL}") from None
        self.client_class = GenericEnvClient
        schema = _schema(target.where, timeouts.connect_s, self.who)
        self.field = action_field(schema.get("action"), self.who)

    def open(self) -> RemoteSession:
        return RemoteSession(self)


class RemoteSession:
    def __init__(self, connector: Remote) -> None:
        self.who, self.field, self.timeouts = connector.who, connector.field, connector.timeouts
        self.client = connector.client_class(
            base_url=connector.target.where, connect_timeout_s=self.timeouts.connect_s, mode="simulation",
            message_timeout_s=self.timeouts.answer_s, max_message_size_mb=self.timeouts.max_message_bytes / 2**20).sync()

    def reset(self, seed: int) -> Observed:
        return self._observed("reset", lambda: self.client.reset(seed=seed))

    def step(self, text: str) -> Observed:
        return self._observed("step", lambda: self.client.step({self.field: text}))

    def close(self) -> None:
        _close_quietly(self.client)

    def _observed(self, what: str, request: Callable[[], Any]) -> Observed:
        try:
            result = request()
        except Exception as error:
            self.close()
            raise EnvironmentFailure(f"{self.who}: {what}: {_network_failure(error, self.timeouts)}") from None
        return observed(result.observation, result.done, result.reward, {}, self.who)


def _network_failure(error: Exception, timeouts: Timeouts) -> str:
    """What went wrong with a server, in words: no answer in time, a connection gone, its own error."""
    from websockets.exceptions import ConnectionClosed

    if isinstance(error, TimeoutError):
        return f"no answer within {timeouts.answer_s:g} s"
    if isinstance(error, ConnectionClosed):
        return f"the connection closed ({one_line(error, 160)})"
    return f"{type(error).__name__}: {one_line(error)}"


def _schema(url: str, timeout_s: float, who: str) -> Mapping[str, Any]:
    """The server's /schema (its action model's JSON schema among them), read within bounds."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    address = parts._replace(scheme=scheme).geturl().rstrip("/") + "/schema"
    # A proxy never sees a loopback server's address; elsewhere the usual proxy variables apply.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({} if is_loopback(parts.hostname or "") else None))
    try:
        with opener.open(address, timeout=timeout_s) as answer:
            body = answer.read(MAX_SCHEMA_BYTES + 1)
    except Exception as error:
        raise EnvironmentFailure(f"{who}: cannot read the server's schema at {address}: {type(error).__name__}: "
                                 f"{one_line(error)}") from None
    if len(body) > MAX_SCHEMA_BYTES:
        raise EnvironmentFailure(f"{who}: the server's schema is over {MAX_SCHEMA_BYTES:,} bytes")
    try:
        schema = json.loads(body)
    except ValueError as error:
        raise EnvironmentFailure(f"{who}: the server's schema is not JSON ({one_line(error, 80)})") from None
    if not isinstance(schema, dict):
        raise EnvironmentFailure(f"{who}: the server's schema is {type(schema).__name__}, not an object")
    return schema
