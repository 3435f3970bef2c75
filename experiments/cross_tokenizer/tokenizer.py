"""A tokenizer of another family, trained here: byte-level BPE on a task's own text, with a
chat template unlike SmolLM2's (Zephyr-style role tokens, not ChatML).

It makes a student whose tokens the packaged SmolLM2 cannot read id by id, so that a teacher with
another tokenizer can be exercised offline (`teacher.tokenizer = 'own'`)."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, lowercase: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `vocab_size` trained on `texts` (every text round-trips, as in
    GPT-2's tokenizer). `lowercase` adds a normaliser that lowercases: a tokenizer some texts do not
    round-trip through, for tests of that check."""
    tokenizer = Tokenizer(models.BPE())
    if lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast
