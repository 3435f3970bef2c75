"""A model's own chat template, rendered under the bounds of selfopd's templates.

A model folder's chat template (`chat_template.jinja`, or `chat_template` in its
tokenizer_config.json) is code from elsewhere, and transformers' `apply_chat_template` renders it
in Jinja's sandbox with no bound on time or size: a template of nested loops hangs `selfopd eval`
or a run at its first prompt. Here the tokenizer's template text renders in selfopd's bounded
sandbox (`sandbox`: size, work and CPU time of one prompt), set up as transformers sets up its own
(trim_blocks, lstrip_blocks, loop controls, the `{% generation %}` tag, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`) and given the same variables (the tokenizer's
special tokens, the role's chat-template arguments over them, `messages`, `tools` (None, or the
role's tool definitions when its arguments carry them), `documents` None, `add_generation_prompt`);
the ids are the tokenizer's of that text without special tokens.
Both are what `apply_chat_template` gives (tests/templating/test_chat_template.py compares them);
a template past a bound is a TemplateLimitError naming the model's template file and the limit.
A tokenizer whose `apply_chat_template` is its own (not a Jinja template: mistral-common's) is
called as it is.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from jinja2 import nodes
from jinja2.exceptions import TemplateError as JinjaTemplateError
from jinja2.ext import Extension, loopcontrols

from selfopd.templating.errors import TemplateError, TemplateLimitError
from selfopd.templating.sandbox import LIMITS_DOC, MAX_RENDER_CHARS, RenderLimit, Sandbox, guarded_filter, render_budget

FILENAME = "<chat template>"  # what the compiled template's frames carry, to find the line that failed


def chat_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
              template_kwargs: Mapping[str, Any]) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, ...)`, rendered within the bounds."""
    if _own_renderer(tokenizer):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **template_kwargs)
    template = _compiled(tokenizer.get_chat_template())
    # `tools` (a role's tool definitions, `selfopd.episodes.tools`) comes with the role's arguments.
    variables = {"tools": None, "documents": None, **tokenizer.special_tokens_map, **template_kwargs}
    pieces, size = [], 0
    try:
        with render_budget():
            for piece in template.generate(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                           **variables):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise RenderLimit(f"renders over {MAX_RENDER_CHARS:,} characters, the size limit of a prompt "
                                      f"({LIMITS_DOC})")
                pieces.append(piece)
    except RenderLimit as error:
        raise TemplateLimitError(f"{template_location(tokenizer, error)}: the model's chat template: {error}") from None
    except RecursionError:
        raise TemplateLimitError(f"{template_location(tokenizer, None)}: the model's chat template calls itself "
                                 "past Python's recursion limit") from None
    except JinjaTemplateError as error:  # raise_exception('...'), or an error in the template itself
        raise ChatTemplateError(f"{template_location(tokenizer, error)}: the model's chat template: "
                                f"{type(error).__name__}: {error}", str(error)) from None
    return "".join(pieces)


class ChatTemplateError(TemplateError, JinjaTemplateError):
    """A model's chat template that raised (`raise_exception`, or a template error): one line naming the
    model's file for selfopd's commands, and still the jinja2 error transformers' callers catch."""

    def __init__(self, message: str, raised: str) -> None:
        super().__init__(message)
        self.raised = raised


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
             template_kwargs: Mapping[str, Any]) -> list[int]:
    """`tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, ...)`, rendered
    within the bounds: the ids of `chat_text`, no special tokens added."""
    if _own_renderer(tokenizer):
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False, **template_kwargs))
    text = chat_text(tokenizer, messages, add_generation_prompt, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _own_renderer(tokenizer: Any) -> bool:
    """Whether the tokenizer renders chats its own way, not with transformers' Jinja rendering."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return getattr(type(tokenizer), "apply_chat_template", None) is not PreTrainedTokenizerBase.apply_chat_template


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, with which a template marks the assistant's text for
    transformers' assistant-token mask (which selfopd never asks for): the text renders as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise JinjaTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002  (transformers' name for it)
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    """The template `source` compiled in a bounded sandbox set up as transformers sets up its own."""
    environment = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    environment.filters["tojson"] = guarded_filter("tojson", _tojson)
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    code = environment.compile(source, filename=FILENAME)
    return environment.template_class.from_code(environment, code, environment.make_globals(None))


def template_location(tokenizer: Any, error: BaseException | None) -> str:
    """The model's file that holds the tokenizer's chat template, with the line `error` was raised
    at: 'FOLDER/chat_template.jinja:3', 'FOLDER/tokenizer_config.json (its chat_template, line 3)',
    or the tokenizer's folder when no file of it holds that template (one set in code)."""
    line = None
    traceback = error.__traceback__ if error is not None else None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == FILENAME:
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    source = tokenizer.get_chat_template()
    jinja = folder / "chat_template.jinja"
    if jinja.is_file() and jinja.read_text(errors="replace") == source:
        return f"{jinja}:{line}" if line else str(jinja)
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (path := folder / name).is_file() and _holds(path, source):
            return f"{path} (its chat_template{f', line {line}' if line else ''})"
    return f"{folder} (its tokenizer's chat template{f', line {line}' if line else ''})"


def _holds(path: Path, source: str) -> bool:
    """Whether the JSON file `path` gives `source` as its chat_template (one, or one of several)."""
    try:
        given = json.loads(path.read_text()).get("chat_template")
    except (ValueError, OSError, AttributeError):
        return False
    templates = given if isinstance(given, list) else [given]
    return any(source in (item, item.get("template") if isinstance(item, dict) else None) for item in templates)
