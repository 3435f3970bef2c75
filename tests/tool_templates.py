"""Chat templates with tool support, written for the tests on SmolLM2's tokens (`<|im_start|>`,
`<|im_end|>`): the tiny family models (tests/conftest.py `save_tiny_family`) carry SmolLM2's own
template, which has none. Each renders what its family's template renders around tools, in its own
words:

- HERMES_TEMPLATE, Qwen3's way: the tool definitions as JSON lines inside `<tools></tools>` in the
  system turn, calls written as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  and a run of `tool` messages as one user turn of `<tool_response>` blocks.
- XML_TEMPLATE, Qwen3.5's way: the same definitions, calls written as
  `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`,
  tool results as above, and a generation prompt that opens a reasoning block (`<think>\\n`).
"""

from __future__ import annotations

# The system turn: a system message's text (or SmolLM2's default), then the tools' block.
_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set rest = messages[1:] %}"
    "{%- else %}{% set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}"
    "{% set rest = messages %}{% endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nThese functions are yours to call:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{% endfor %}{{- '\\n</tools>\\n\\n' + HOW }}{% endif %}"
    "{{- '<|im_end|>\\n' }}"
)
# Every turn after the system's: a run of tool messages is one user turn of <tool_response> blocks.
_TURNS = (
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
)
HERMES_HOW = ("To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
              "tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>")
XML_HOW = ("To call a function, write:\\n<tool_call>\\n<function=the_function_name>\\n<parameter=the_parameter>\\n"
           "its value\\n</parameter>\\n</function>\\n</tool_call>")

HERMES_TEMPLATE = (
    "{%- set HOW = '" + HERMES_HOW + "' %}" + _SYSTEM + _TURNS
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)
XML_TEMPLATE = (
    "{%- set HOW = '" + XML_HOW + "' %}" + _SYSTEM + _TURNS
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
# A template that reads `tools` and writes calls in a way selfopd does not parse.
UNKNOWN_FORMAT_TEMPLATE = (
    "{%- set HOW = 'Call a function as [CALL name(args)].' %}" + _SYSTEM + _TURNS
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {"json": HERMES_TEMPLATE, "xml": XML_TEMPLATE}  # by the tool format each asks for


def tool_tokenizer(folder, template: str):
    """The tokenizer of the model `folder` with `template` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    return tokenizer


def tool_model_dir(model_dir, folder, template: str):
    """A copy of the model folder `model_dir` at `folder` whose tokenizer has `template`."""
    import shutil
    from pathlib import Path

    folder = Path(folder)
    shutil.copytree(model_dir, folder)
    for stale in folder.glob("chat_template.*"):
        stale.unlink()
    tool_tokenizer(model_dir, template).save_pretrained(folder)
    return folder
