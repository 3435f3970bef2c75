"""A thinking-style chat template written for the tests: SmolLM2's own template plus what Qwen3's
does with `enable_thinking = false`, an empty `<think>\\n\\n</think>\\n\\n` block after the assistant
header, in the generation prompt and before a finished assistant turn's text (so the generation
prompt still ends where the assistant's text starts). Without the argument it renders exactly as
SmolLM2's template does."""

from __future__ import annotations

import shutil
from pathlib import Path

EMPTY_THINK = "<think>\n\n</think>\n\n"
THINKING_TEMPLATE = (
    "{% set skip = enable_thinking is defined and enable_thinking is false %}"
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and skip %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if skip %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def thinking_tokenizer(folder: str | Path):
    """The tokenizer of the model `folder` with THINKING_TEMPLATE as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def thinking_model_dir(model_dir: str | Path, folder: Path) -> Path:
    """A copy of the model folder `model_dir` at `folder` whose tokenizer has THINKING_TEMPLATE."""
    shutil.copytree(model_dir, folder)
    for stale in folder.glob("chat_template.*"):
        stale.unlink()
    thinking_tokenizer(model_dir).save_pretrained(folder)
    return folder
