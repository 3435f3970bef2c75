"""What differs between model families, in one place: how a family's caches, layers and weight
names map, asked of one `Family` record instead of conditionals spread through the engines, the
trainer and the weight push.

A family is found from a model's config (`family_of`): its `model_type`, or its text config's for a
multimodal checkpoint (Qwen3.5's hub checkpoints are `Qwen3_5ForConditionalGeneration`, a language
model with a vision tower). A model of no listed family gets `GENERIC`: what a plain decoder-only
transformer with a standard KV cache (Llama, Mistral, Qwen2, SmolLM2) does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """One model family's answers."""

    name: str
    # config.model_type values of the family (top-level and text config).
    model_types: tuple[str, ...]
    # Why the prompt-sharing scoring path (one prompt pass, its cache selected per row) cannot run on
    # this family's cache; "" when it can. Scoring then runs one pass over prompt + completion.
    no_shared_prompt_cache: str = ""


GENERIC = Family("generic", ())

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",)),
    Family("qwen3", ("qwen3",)),
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"),
           no_shared_prompt_cache="its Gated DeltaNet layers keep a recurrent state that transformers' cache cannot "
                                  "select per row"),
)


def family_of(config: Any) -> Family:
    """The family of a model with this transformers config (or of the language model inside it)."""
    types = {getattr(config, "model_type", None)}
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        types.add(getattr(text_config, "model_type", None))
    for family in FAMILIES:
        if types & set(family.model_types):
            return family
    return GENERIC
