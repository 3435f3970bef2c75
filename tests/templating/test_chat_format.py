"""The chat format of a role: exact prompt ids, the reasoning-block flag decided when a prompt is
tokenized (the rule grading used to apply to each rollout), a completion read back as the user
sees it, and a conversation rendered turn by turn with the ids of a one-shot render wherever the
template renders each turn the same wherever it stands."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from selfopd.data.example import Example
from selfopd.templating.chat_format import ChatFormat, PromptIds
from selfopd.templating.chat_template import chat_ids
from selfopd.templating.errors import TemplateError
from selfopd.verifiers import Grading
from tests.thinking_template import THINKING_TEMPLATE

# Qwen3's chat template without tools, as it ships: an assistant turn after the last user message
# keeps its reasoning (the last one always, with an empty block when it has none), one before it
# loses it; tool results are user turns of <tool_response> blocks; enable_thinking = false puts
# an empty block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in message.content %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# A template that opens the reasoning block for the model (Qwen3-Thinking-2507's, DeepSeek-R1's).
OPENING_TEMPLATE = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")


def _tokenizer(smollm2_dir, template: str | None):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _sampled(tokenizer, text: str) -> list[int]:
    """What a sampler gives for an assistant turn `text`: its tokens, then the stop token."""
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _episode(chat: ChatFormat, conversation: list[dict]) -> tuple[list[int], list[list[int]]]:
    """The conversation rendered turn by turn: (the final ids, the prompt ids before each assistant turn)."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    ids, prompts, pending = chat.prompt_ids(conversation[:first]), [], []
    for message in conversation[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            ids, pending = chat.append(ids, pending), []
        prompts.append(list(ids))
        ids = [*ids, *_sampled(chat.tokenizer, message["content"])]
    return (chat.append(ids, pending) if pending else ids), prompts


CALL = {"role": "assistant", "content": "I will ask the calculator for 17 * 23."}
TOOL = {"role": "tool", "content": "391"}
USER = {"role": "user", "content": "And 391 + 9?"}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 * 23?"}, CALL, TOOL],  # 2 turns: a tool result after the first
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 23?"}, CALL, TOOL,
     {"role": "assistant", "content": "It is 391."}, USER],  # 3: a tool result, then a user's reply
    [{"role": "user", "content": "What is 17 * 23?"}, CALL, TOOL, TOOL,
     {"role": "assistant", "content": "Two results, both 391."}, USER, {"role": "assistant", "content": "400."},
     {"role": "user", "content": "Thanks."}],  # 4: two tool results, then two user replies
]


@pytest.mark.parametrize("template, kwargs", [(None, {}), (QWEN3_TEMPLATE, {}),
                                              (THINKING_TEMPLATE, {"enable_thinking": False})])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["2 turns", "3 turns", "4 turns"])
def test_turn_by_turn_ids_are_a_one_shot_render_where_the_template_renders_each_turn_alike(
        smollm2_dir, template, kwargs, conversation):
    """SmolLM2's shipped template, Qwen3's with answers without reasoning, and the thinking-style one with
    enable_thinking = false: each turn's prompt, built by appending to the sampler's exact ids, is the
    one-shot render of the conversation so far, and the whole conversation is the one-shot render's text.
    Its ids are the one-shot render's too, except where the generation prompt ends in text the tokenizer
    would merge with the answer's first characters: the thinking-style template's prompt ends with
    '</think>\\n\\n', one token as the sampler was given it, while a one-shot render tokenizes '\\n\\nI' as
    '\\n', '\\nI' (and so every later turn's prompt, which holds that answer). The sampler's ids are the ones to train on (the single-turn pipeline, too, trains on
    prompt ids + the sampled ids, never on a re-tokenization)."""
    chat = ChatFormat(_tokenizer(smollm2_dir, template), kwargs)
    ids, prompts = _episode(chat, conversation)
    turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    assert [chat.tokenizer.decode(p) for p in prompts] == [chat.text(conversation[:i]) for i in turns]
    assert chat.tokenizer.decode(ids) == chat.text(conversation)
    exact = template is not THINKING_TEMPLATE
    assert (prompts == [chat_ids(chat.tokenizer, conversation[:i], True, kwargs) for i in turns]) is (exact or
                                                                                                   len(turns) == 1)
    assert (ids == chat_ids(chat.tokenizer, conversation, True, kwargs)) is exact


def test_a_thinking_template_drops_earlier_reasoning_from_a_one_shot_render_and_an_episode_keeps_it(smollm2_dir):
    """Qwen3's template keeps the reasoning of the assistant turns after the last user message and drops
    it from those before. So within one user message (tool calls and results) the turn-by-turn ids are the
    one-shot render; once a user replies, the one-shot render of the conversation has lost the earlier
    turns' reasoning, while the model was prompted with it and sampled it: those sampled tokens are in
    no one-shot render any more. An episode trains on the ids the sampler saw and gave, every turn's
    exact tokens in one sequence (the sampler's logprobs and the trainer's are of the same tokens in
    the same context): the turn-by-turn ids."""
    chat = ChatFormat(_tokenizer(smollm2_dir, QWEN3_TEMPLATE))
    first = {"role": "assistant", "content": "<think>\nI need 17 * 23.\n</think>\n\nCalling the calculator."}
    second = {"role": "assistant", "content": "<think>\nThe tool says 391.\n</think>\n\n391."}
    question = [{"role": "user", "content": "What is 17 * 23?"}]
    within = [*question, first, TOOL, second]  # one user message: reasoning after it is kept
    ids, prompts = _episode(chat, within)
    assert prompts == [chat.prompt_ids(within[:i]) for i in (1, 3)]
    assert ids[: len(chat.ids(within, False)) - 1] == chat.ids(within, False)[:-1]  # all but the closing newline

    replied = [*within, USER]
    ids, _ = _episode(chat, replied)
    one_shot = chat.prompt_ids(replied)
    assert ids != one_shot
    text, shot_text = chat.tokenizer.decode(ids), chat.tokenizer.decode(one_shot)
    assert "I need 17 * 23." in text and "The tool says 391." in text  # every turn's reasoning, as sampled
    assert "I need 17 * 23." not in shot_text and "The tool says 391." not in shot_text  # dropped before the reply
    assert shot_text == text.replace("<think>\nI need 17 * 23.\n</think>\n\n", "").replace(
        "<think>\nThe tool says 391.\n</think>\n\n", "")  # the only difference
    for turn in (first, second):  # the sampler's exact ids of each turn stand in the episode's ids
        sampled = _sampled(chat.tokenizer, turn["content"])
        assert any(ids[i : i + len(sampled)] == sampled for i in range(len(ids)))
        assert not any(one_shot[i : i + len(sampled)] == sampled for i in range(len(one_shot)))


def test_a_turn_appends_after_a_completion_cut_before_its_stop_token(smollm2_dir):
    """A completion cut at max_tokens has no stop token: the whole end of the turn is appended."""
    chat = ChatFormat(_tokenizer(smollm2_dir, None))
    prompt = chat.prompt_ids([{"role": "user", "content": "Count."}])
    cut = chat.tokenizer("one two three", add_special_tokens=False)["input_ids"]
    appended = chat.append([*prompt, *cut], [USER])
    assert chat.tokenizer.decode(appended[len(prompt) + len(cut):]).startswith("<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(TemplateError, match="sampler's exact ids"):
        chat.append(prompt, [CALL])


@pytest.mark.parametrize("template, kwargs, opens", [
    (None, {}, False),  # SmolLM2: no reasoning blocks
    (THINKING_TEMPLATE, {"enable_thinking": False}, False),  # an empty block, closed in the prompt
    (OPENING_TEMPLATE, {}, True),  # the prompt opens <think> for the model
])
def test_the_prompt_says_whether_its_template_opened_a_reasoning_block(smollm2_dir, template, kwargs, opens):
    """Decided once when the prompt is tokenized, by the rule grading applied to every rollout before:
    the last 16 prompt tokens decoded end with the reasoning start."""
    tokenizer = _tokenizer(smollm2_dir, template)
    chat = ChatFormat(tokenizer, kwargs, Grading())
    messages = [{"role": "user", "content": "What is 2 + 2? " * 40}]
    prompt = chat.prompt(messages)
    assert prompt == PromptIds(chat_ids(tokenizer, messages, True, kwargs), opens)
    assert Grading().opens_reasoning(tokenizer.decode(prompt.ids[-16:])) is opens  # the rule as it was
    assert ChatFormat(tokenizer, kwargs, Grading("", "")).prompt(messages).opens_reasoning is False


def test_a_completion_reads_back_as_the_user_sees_it(smollm2_dir):
    chat = ChatFormat(_tokenizer(smollm2_dir, OPENING_TEMPLATE))
    seven = Example(id="q", prompt="3 + 4?", answer="7")
    reading = chat.read("3 + 4 = 7\n</think>\n\nThe answer is \\boxed{7}.", "stop", opened=True)
    assert (reading.final, reading.truncated) == ("\n\nThe answer is \\boxed{7}.", False)
    assert chat.read("3 + 4 = 7, so \\boxed{7}", "stop", opened=True).final is None  # never closed the block
    assert chat.read("\\boxed{7}", "length").truncated
    assert chat.grade("</think>\\boxed{7}", seven, opened=True).correct
    assert not chat.grade("\\boxed{7}", seven, opened=True).correct
    assert not chat.grade("</think>\\boxed{7}", seven, "length", opened=True).correct  # truncated: wrong


def test_of_reads_the_grading_of_a_config_section(smollm2_dir):
    from selfopd.config import load_config

    config = load_config(None, ["verifier.truncated=grade"])
    chat = ChatFormat.of(_tokenizer(smollm2_dir, None), {"enable_thinking": False}, config.verifier)
    assert chat.grading == Grading("<think>", "</think>", "grade")
    assert dict(chat.template_kwargs) == {"enable_thinking": False}
