"""selfopd.templating.token_bridge with chat-template arguments: the boundary check and the
teacher's prompt are rendered with the role's arguments (a thinking-style template written for
the tests, `tests.thinking_template`)."""

from __future__ import annotations

import pytest

from selfopd.templating.templates import prompt_token_ids
from selfopd.templating.token_bridge import ChatBoundaryError, TokenBridge, turn_end
from tests.thinking_template import EMPTY_THINK, thinking_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def test_the_boundary_check_renders_with_the_roles_arguments(smollm2_dir):
    """SmolLM2's tokenizer writes '\\n\\n' before a word as two tokens, so the empty think block's
    trailing '\\n\\n' is not where a finished answer's tokens start: refused, with the argument only."""
    thinking = thinking_tokenizer(smollm2_dir)
    end = turn_end(thinking, "teacher")
    assert thinking.decode([end]) == "<|im_end|>"
    with pytest.raises(ChatBoundaryError, match="teacher's chat template: the generation prompt"):
        turn_end(thinking, "teacher", {"enable_thinking": False})


def test_the_bridges_teacher_prompt_uses_the_teachers_arguments(smollm2_dir, smollm2_tokenizer):
    thinking = thinking_tokenizer(smollm2_dir)
    bridge = TokenBridge(smollm2_tokenizer, thinking, 2, 2, False, {"enable_thinking": False})
    ids = bridge.prompt_ids(MESSAGES)
    assert ids == prompt_token_ids(thinking, MESSAGES, {"enable_thinking": False})
    assert thinking.decode(ids).endswith(EMPTY_THINK)
