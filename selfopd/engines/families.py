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


# Layer types whose cache is keys and values only (transformers' `config.layer_types` values).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def shared_prompt_cache_problem(config: Any) -> str:
    """Why a model with this config cannot score through a shared prompt cache ("" when it can):
    its family's reason, or, for a model of no listed family, any layer that is not attention
    (a hybrid's recurrent or convolution state, which transformers' cache cannot select per row)."""
    family = family_of(config)
    if family.no_shared_prompt_cache:
        return f"{family.name}: {family.no_shared_prompt_cache}"
    text_config = getattr(config, "text_config", None) or config
    others = sorted(set(getattr(text_config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if others:
        return (f"{getattr(text_config, 'model_type', family.name)}: its {', '.join(others)} layers keep a state "
                "that transformers' cache cannot select per row")
    return ""
