"""Tool calls in the model family's own format: the chat template's `tools`.

A tool is a typed Python function whose docstring says what it does and what each argument is,
as in TRL (whose environment classes' public methods are their tools: `selfopd.episodes.trl_environment`);
`tool_schemas` turns them into the definitions the chat template shows the model (transformers'
`get_json_schema`). With `rollout.environment = "tools"` the student's prompts and every teacher's
carry the same definitions (`selfopd.episodes.prompt_tools`, merged into the student's chat-template
arguments that each teacher's merge over). How the family writes a call is read once from the
student's chat-template text (`tool_format`):

- "json", Qwen3's (Hermes'): `<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+3"}}\\n</tool_call>`
- "xml", Qwen3.5's (Qwen3-Coder's): `<tool_call>\\n<function=calculator>\\n<parameter=expression>\\n2+3\\n</parameter>\\n</function>\\n</tool_call>`

and a template that never reads `tools` is refused in one line naming the model.

`ToolEnvironment` runs an episode: a reply with calls gets one `tool` message per call (the tool's
result, or one line saying what was wrong: a malformed call, an unknown tool, missing, extra or
mistyped arguments, a tool that raised), and the episode goes on; a reply without a call is the
final answer, graded by the task's verifier. Calls are read from what the user would see of a
reply (`ChatFormat.read`): a call written inside a reasoning block is thinking, not a call, as
vLLM's reasoning parsers have it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from selfopd.config.settings import ConfigError
from selfopd.data.example import Example
from selfopd.episodes.environment import Environment, Response
from selfopd.episodes.toolbox import calculator, python, quote
from selfopd.verifiers import VerifyResult

ToolFormat = Literal["json", "xml"]
# The tools `rollout.tools` names (selfopd.config's ToolName lists the same names).
TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean",
               type(None): "null"}
ERROR_CHARS = 300  # an exception's message, in the one line a failed call gets


class ToolError(ValueError):
    """A tool, or a chat template, that cannot take part in a tool-calling episode: one line."""


# The definitions a prompt carries.

def tool_schemas(tools: Mapping[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """Each tool's definition, in order, named by its key: transformers' `get_json_schema` of the
    function (its type hints and its docstring's `Args:`), as `apply_chat_template(tools=...)` takes it."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, function in tools.items():
        if not _NAME.fullmatch(name):
            raise ToolError(f"tool name {quote(name)}: expected letters, digits, '_', '.' or '-' (64 at most)")
        try:
            schema = get_json_schema(function)
        except Exception as error:  # no docstring, an argument without a type hint or a description
            raise ToolError(f"tool {name!r}: {' '.join(str(error).split())}") from None
        schema["function"]["name"] = name
        schemas.append(schema)
    return schemas


def registered_tools(names: Sequence[str]) -> dict[str, Callable[..., Any]]:
    """The tools of `TOOLS` that `names` (rollout.tools) names, in that order."""
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise ToolError(f"no tool {unknown[0]!r}; selfopd's tools: {', '.join(TOOLS)}")
    return {name: TOOLS[name] for name in names}


def builtin_tool_kwargs(rollout: Any) -> dict[str, Any]:
    """With rollout.environment = "tools": `tools`, the definitions of rollout.tools (what every prompt of the
    run shows: `selfopd.episodes.prompt_tools`); else none."""
    if rollout.environment != "tools":
        return {}
    return {"tools": tool_schemas(registered_tools(rollout.tools))}


# The family's format, from its chat template.

def tool_format(template: str, model: str) -> ToolFormat:
    """How the chat template `template` (of `model`, for the message) writes a call; ToolError when it
    shows no tools, or writes calls in a format selfopd does not read."""
    if not re.search(r"\btools\b", template):
        raise ToolError(f"{model}: its chat template never reads `tools`, so a prompt cannot show the tools; "
                        "tool-calling episodes need a model family whose template has them (Qwen3, Qwen3.5)")
    if "<function=" in template:
        return "xml"
    if OPEN in template:
        return "json"
    raise ToolError(f"{model}: its chat template shows tools but asks for calls in a format selfopd does not read "
                    f"(it reads Qwen3's {OPEN}{{json}}{CLOSE} and Qwen3.5's {OPEN}<function=NAME>...)")


def chat_tool_format(chat: Any) -> ToolFormat:
    """The tool format of a `ChatFormat`'s template, checked by rendering: its template must show the
    tools its arguments carry and a `tool` message's content (else ToolError, one line naming the model)."""
    model = str(getattr(chat.tokenizer, "name_or_path", "") or "the student")
    try:
        template = chat.tokenizer.get_chat_template()
    except ValueError:
        raise ToolError(f"{model}: its tokenizer has no chat template") from None
    found = tool_format(template, model)
    tools = chat.template_kwargs.get("tools") or ()
    marker = "selfopd tool result"
    try:
        text = chat.text([{"role": "user", "content": "?"}, {"role": "tool", "name": "t", "content": marker}])
    except Exception as error:
        raise ToolError(f"{model}: its chat template cannot render a tool's result: "
                        f"{' '.join(str(error).split())[:ERROR_CHARS]}") from None
    missing = [s["function"]["name"] for s in tools if s["function"]["name"] not in text]
    if missing or marker not in text:
        what = f"the tool {missing[0]!r}" if missing else "a tool's result"
        raise ToolError(f"{model}: its chat template does not show {what} in the prompt")
    return found


# A reply's calls.

@dataclass(frozen=True)
class ToolCall:
    """One call as the student wrote it. `problem`: why it cannot run, one line ('' when it parsed).
    `as_text`: its argument values are text, read as each parameter's type says (the xml format's)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    problem: str = ""
    as_text: bool = False


def parse_tool_calls(text: str, fmt: ToolFormat) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of `text` in order, parsed in format `fmt`; a block
    that does not parse is a `ToolCall` with its `problem`. A block left open ends the list."""
    calls: list[ToolCall] = []
    start = 0
    while (opened := text.find(OPEN, start)) >= 0:
        body = opened + len(OPEN)
        closed = text.find(CLOSE, body)
        if closed < 0:
            calls.append(ToolCall("", problem=f"no closing {CLOSE} (the reply ended inside the call)"))
            break
        calls.append(_json_call(text[body:closed]) if fmt == "json" else _xml_call(text[body:closed]))
        start = closed + len(CLOSE)
    return calls


def _json_call(body: str) -> ToolCall:
    """`{"name": ..., "arguments": {...}}` (arguments may also come as a JSON string of an object)."""
    value, problem = _json(body)
    if problem:
        return ToolCall("", problem=f"{problem}: {quote(body.strip())}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"].strip():
        return ToolCall("", problem=f'not {{"name": ..., "arguments": {{...}}}}: {quote(body.strip())}')
    name, arguments = value["name"].strip(), value.get("arguments", {})
    if isinstance(arguments, str):
        decoded, problem = _json(arguments)
        arguments = decoded if isinstance(decoded, dict) and not problem else arguments
    if not isinstance(arguments, dict):
        return ToolCall(name, problem=f"the arguments of {quote(name)} are {_json_type(arguments)}, not an object")
    return ToolCall(name, arguments)


def _json(text: str) -> tuple[Any, str]:
    """(`text` as JSON, ''), or (None, 'not JSON (why)')."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as error:
        return None, f"not JSON ({error.msg} at character {error.pos})"
    except (ValueError, RecursionError) as error:  # an integer past Python's digit limit; nesting past the stack
        return None, f"not JSON selfopd reads ({type(error).__name__})"


def _xml_call(body: str) -> ToolCall:
    """`<function=NAME><parameter=P>value</parameter>...</function>`, each value one newline in from
    its tags (as Qwen3.5's template writes it), kept as text."""
    match = _XML_FUNCTION.fullmatch(body)
    if match is None:
        return ToolCall("", problem=f"not <function=NAME>...</function>: {quote(body.strip())}")
    name, inner = match[1].strip(), match[2]
    if not name:
        return ToolCall("", problem="no function name in <function=...>")
    arguments: dict[str, str] = {}
    position = 0
    for parameter in _XML_PARAMETER.finditer(inner):
        between = inner[position:parameter.start()]
        if between.strip():
            return ToolCall(name, problem=f"text outside its <parameter> tags: {quote(between.strip())}")
        key = parameter[1].strip()
        if key in arguments:
            return ToolCall(name, problem=f"the parameter {quote(key)} given twice")
        value = parameter[2]
        value = value[1:] if value.startswith("\n") else value
        arguments[key] = value[:-1] if value.endswith("\n") else value
        position = parameter.end()
    if inner[position:].strip():
        return ToolCall(name, problem=f"text outside its <parameter> tags: {quote(inner[position:].strip())}")
    return ToolCall(name, arguments, as_text=True)


# Running a call.

@dataclass(frozen=True)
class Toolset:
    """Tools by name, their definitions, and the format the student's family writes calls in."""

    tools: Mapping[str, Callable[..., Any]]
    format: ToolFormat
    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.schemas:
            object.__setattr__(self, "schemas", {s["function"]["name"]: s for s in tool_schemas(self.tools)})

    def parse(self, text: str) -> list[ToolCall]:
        return parse_tool_calls(text, self.format)

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """(the `tool` message's content, whether the tool ran and returned): its result as text, or
        one line starting 'error:' saying what was wrong. Never raises for anything the call holds."""
        if call.problem:
            return f"error: tool call {quote(call.name) + ' ' if call.name else ''}not run: {call.problem}", False
        if call.name not in self.tools:
            return f"error: there is no tool {quote(call.name)}; the tools: {', '.join(self.tools)}", False
        try:
            arguments = checked_arguments(call, self.schemas[call.name])
        except ToolError as error:
            return f"error: {error}", False
        try:
            return tool_text(self.tools[call.name](**arguments)), True
        except Exception as error:  # the tool's own failure: the student reads it, the episode goes on
            message = " ".join(str(error).split())[:ERROR_CHARS]
            return f"error: {call.name}: {type(error).__name__}: {message}".rstrip(": "), False


def checked_arguments(call: ToolCall, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments checked against its tool's definition: no unknown name, every required one,
    each of its declared JSON type (text values read as that type first); else ToolError, one line."""
    parameters = schema["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    for key in call.arguments:
        if key not in properties:
            raise ToolError(f"{call.name} takes no argument {quote(str(key))} (its arguments: "
                            f"{', '.join(properties) or 'none'})")
    for key in parameters.get("required") or ():
        if key not in call.arguments:
            raise ToolError(f"{call.name} needs the argument {key!r}")
    return {key: _typed(call.name, key, value, properties[key], call.as_text) for key, value in call.arguments.items()}


def _typed(tool: str, key: str, value: Any, spec: Mapping[str, Any], as_text: bool) -> Any:
    declared = spec.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or ())
    if spec.get("nullable"):
        types.append("null")
    if not types:  # the definition does not say: as written
        return value
    if as_text and "string" not in types:
        decoded, problem = _json(value)
        if problem:
            raise ToolError(f"{tool}'s argument {key!r} is {quote(value)}, not {' or '.join(types)}")
        value = decoded
    if not any(_is_type(value, t) for t in types):
        raise ToolError(f"{tool}'s argument {key!r} is {_json_type(value)}, not {' or '.join(types)}")
    return value


def _is_type(value: Any, json_type: str) -> bool:
    if json_type == "number":
        return type(value) in (int, float)
    if json_type in _JSON_TYPES.values():
        return _JSON_TYPES.get(type(value)) == json_type
    return True  # a type this check does not know: the tool decides


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def tool_text(result: Any) -> str:
    """A tool's return value as a message's text: text as it is, bytes decoded, JSON values as JSON,
    anything else as `str`; whatever is not UTF-8 (a lone surrogate) replaced."""
    if isinstance(result, bytes):
        text = result.decode("utf-8", errors="replace")
    elif isinstance(result, str):
        text = result
    elif result is None or isinstance(result, (dict, list, tuple, int, float, bool)):
        try:
            text = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(result)
    else:
        text = str(result)
    return text.encode("utf-8", errors="replace").decode("utf-8")


# The episode.

class ToolEnvironment:
    """A tool-calling episode: each reply's calls run (at most `max_calls` per episode), their results
    the next turn's `tool` messages; a reply without a call is the answer, graded by `grade` (the
    task's verifier). `read(reply, finish_reason)`: what the user sees of a reply (None: nothing, it
    ended inside its reasoning), where calls are looked for."""

    def __init__(self, toolset: Toolset, grade: Callable[[str, Example, str], VerifyResult], max_calls: int = 4,
                 read: Callable[[str, str], str | None] = lambda reply, finish: reply) -> None:
        self.toolset, self.grade, self.max_calls, self.read = toolset, grade, max_calls, read
        self.example: Example | None = None
        self.calls = self.errors = 0

    def reset(self, example: Example) -> None:
        self.example, self.calls, self.errors = example, 0, 0

    def step(self, reply: str, finish_reason: str) -> Response:
        assert self.example is not None, "reset before step"
        shown = self.read(reply, finish_reason)
        calls = self.toolset.parse(shown) if shown else []
        if not calls:
            verdict = self.grade(reply, self.example, finish_reason)
            return Response((), True, verdict.reward, {**self._counts(), "correct": verdict.correct,
                                                        "feedback": verdict.feedback})
        room = max(self.max_calls - self.calls, 0)
        messages = []
        for call in calls[:room]:
            content, ran = self.toolset.run(call)
            self.errors += not ran
            messages.append({"role": "tool", "name": call.name, "content": content})
        self.calls += min(len(calls), room)
        if len(calls) > room:
            skipped = len(calls) - room
            messages.append({"role": "tool", "name": "", "content": (
                f"error: {skipped} tool call{'s' if skipped > 1 else ''} not run: an episode makes at most "
                f"{self.max_calls}; answer without tools")})
        return Response(tuple(messages), False, None, self._counts())

    def _counts(self) -> dict[str, int]:
        return {"tool_calls": self.calls, "tool_errors": self.errors}


def tool_episodes(rollout: Any, chat: Any, opened: bool, kwargs: Mapping[str, Any]
                  ) -> tuple[Any, ToolFormat, Callable[[Toolset], ToolEnvironment]]:
    """What every tool-calling environment shares: the student's chat format carrying the tools' definitions
    (`kwargs`, as `selfopd.episodes.prompt_tools` gives them), the format its template writes calls in, and
    a `ToolEnvironment` over a toolset (at most rollout.max_tool_calls calls, the answer graded as `chat`
    grades). A student template without tools is refused here, in one line naming the model."""
    if chat.template_kwargs.get("tools") != kwargs["tools"]:
        chat = dataclasses.replace(chat, template_kwargs={**chat.template_kwargs, **kwargs})
    try:
        call_format = chat_tool_format(chat)
    except ToolError as error:
        raise ConfigError("rollout.environment", f"{rollout.environment!r}: {error}") from None

    def episode(toolset: Toolset) -> ToolEnvironment:
        return ToolEnvironment(toolset, lambda reply, e, finish: chat.grade(reply, e, finish, opened),
                               rollout.max_tool_calls, lambda reply, finish: chat.read(reply, finish, opened).final)

    return chat, call_format, episode


def tool_environments(rollout: Any, chat: Any, opened: bool) -> tuple[Any, Callable[[Example], Environment]]:
    """For `episode_sampler`, with rollout.environment = "tools": the student's chat format carrying
    rollout.tools' definitions, and a `ToolEnvironment` per episode over them (`tool_episodes`)."""
    chat, call_format, episode = tool_episodes(rollout, chat, opened, builtin_tool_kwargs(rollout))
    toolset = Toolset(registered_tools(rollout.tools), call_format)  # selfopd's own tools: defined once
    return chat, lambda example: episode(toolset)
