"""selfopd.templating.tokenizer_check: passes the real tokenizer against itself, names every kind of mismatch."""

from __future__ import annotations

import copy
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from selfopd.templating.tokenizer_check import TokenizerMismatch, check_tokenizers_compatible

VOCAB_SIZE = 49152  # SmolLM2's embedding rows: ids 0..49151


@pytest.fixture
def edited(smollm2_tokenizer):
    """A private copy to edit: the session's tokenizer is shared by other tests."""
    return copy.deepcopy(smollm2_tokenizer)


def mismatch(student, teacher, vocab_size: int = VOCAB_SIZE) -> str:
    with pytest.raises(TokenizerMismatch) as caught:
        check_tokenizers_compatible(student, teacher, vocab_size)
    return str(caught.value)


def test_real_tokenizer_is_compatible_with_itself(smollm2_tokenizer):
    check_tokenizers_compatible(smollm2_tokenizer, smollm2_tokenizer, VOCAB_SIZE)


def test_swapped_token_ids_fail_naming_both_tokens(smollm2_tokenizer, tmp_path):
    student = smollm2_tokenizer
    student.save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    assert vocab["Ġcat"] != vocab["Ġdog"]
    vocab["Ġcat"], vocab["Ġdog"] = vocab["Ġdog"], vocab["Ġcat"]
    path.write_text(json.dumps(spec))
    teacher = AutoTokenizer.from_pretrained(tmp_path)
    assert teacher.convert_tokens_to_ids("Ġcat") == student.convert_tokens_to_ids("Ġdog")  # the edit took

    message = mismatch(student, teacher)
    cat, dog = student.convert_tokens_to_ids(["Ġcat", "Ġdog"])
    assert "2 tokens have different ids" in message
    assert f"'Ġcat': student id {cat}, teacher id {dog}" in message
    assert f"'Ġdog': student id {dog}, teacher id {cat}" in message


def test_too_small_teacher_vocab_size_fails_naming_sizes(smollm2_tokenizer):
    message = mismatch(smollm2_tokenizer, smollm2_tokenizer, vocab_size=VOCAB_SIZE - 1)
    assert "vocab size 49151 is smaller than 49152" in message
    assert message.count("\n- ") == 1  # nothing else differs


def test_padded_larger_teacher_vocab_size_passes(smollm2_tokenizer):
    check_tokenizers_compatible(smollm2_tokenizer, smollm2_tokenizer, VOCAB_SIZE + 128)


def test_different_eos_token_fails_naming_eos(edited, smollm2_tokenizer):
    edited.eos_token = "<|endoftext|>"
    message = mismatch(edited, smollm2_tokenizer)
    assert "eos_token differs: student '<|endoftext|>', teacher '<|im_end|>'" in message
    assert message.count("\n- ") == 1  # nothing else differs


def test_different_chat_template_fails(edited, smollm2_tokenizer):
    # ChatML without the newline after the role: same vocab, different prompt ids.
    edited.chat_template = smollm2_tokenizer.chat_template.replace("message['role'] + '\n'", "message['role'] + ' '")
    assert edited.chat_template != smollm2_tokenizer.chat_template
    message = mismatch(edited, smollm2_tokenizer)
    assert "chat templates give different prompt ids for the system + user probe" in message
    assert "<|im_start|>system You are" in message  # shows the student's rendering


def test_textually_different_template_with_same_ids_passes(edited, smollm2_tokenizer):
    # Only the template source differs (`~` joins strings like `+`): the rendered ids are equal.
    template = smollm2_tokenizer.chat_template
    edited.chat_template = template.replace("'<|im_start|>' + message", "'<|im_start|>' ~ message")
    assert edited.chat_template != smollm2_tokenizer.chat_template
    check_tokenizers_compatible(edited, smollm2_tokenizer, VOCAB_SIZE)


def tiny_tokenizer(vocab: dict[str, int], special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with eos `<eos>`, built in memory in milliseconds."""
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def test_missing_token_fails_and_teacher_only_token_passes():
    student = tiny_tokenizer({"<eos>": 0, "a": 1, "b": 2})
    check_tokenizers_compatible(student, tiny_tokenizer({"<eos>": 0, "a": 1, "b": 2, "c": 3}), 4)
    message = mismatch(student, tiny_tokenizer({"<eos>": 0, "a": 1}), 3)
    assert "1 student tokens are missing from the teacher vocab, e.g. 'b' (student id 2)" in message


def test_extra_special_token_fails_naming_it():
    student = tiny_tokenizer({"<eos>": 0, "a": 1, "<ctl>": 2})
    teacher = tiny_tokenizer({"<eos>": 0, "a": 1, "<ctl>": 2}, special=("<ctl>",))
    assert "special tokens only the teacher has, e.g. '<ctl>'" in mismatch(student, teacher, 3)


def test_the_chat_template_check_renders_with_the_teachers_arguments(smollm2_dir, smollm2_tokenizer):
    """Both templates render with the teacher's chat-template arguments: SmolLM2's ignores
    enable_thinking, a thinking template does not, so only with the argument do they differ."""
    from tests.thinking_template import thinking_tokenizer

    thinking = thinking_tokenizer(smollm2_dir)
    check_tokenizers_compatible(smollm2_tokenizer, thinking, VOCAB_SIZE)
    with pytest.raises(TokenizerMismatch, match="different prompt ids.*think"):
        check_tokenizers_compatible(smollm2_tokenizer, thinking, VOCAB_SIZE, template_kwargs={"enable_thinking": False})
    check_tokenizers_compatible(thinking, thinking, VOCAB_SIZE, template_kwargs={"enable_thinking": False})
