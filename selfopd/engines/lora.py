"""LoRA adapters on the trainable student (peft), and everything that must see through them.

With `model.lora_rank > 0` the student is a peft model: the base weights stay frozen and only
the adapters train. Three consequences live here, so no other module needs to know peft:
- a `frozen` teacher is the same module with its adapters off (`adapters_off`): the base
  weights exist once in memory;
- a server that serves the student gets full weights under the base checkpoint's names,
  the adapters merged in (`served_weights`), computed beside the live module, never in it;
- a checkpoint is an adapter folder (adapter_config.json + adapter_model.safetensors), which
  `load_adapted` reads back onto its base and `merge_checkpoint` turns into a full HF folder.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from selfopd.config import ConfigError, ModelConfig
from selfopd.core.models import PACKAGED_MODELS, ModelError, from_pretrained, resolve_model

ADAPTER_CONFIG = "adapter_config.json"


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (the student trained through adapters)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_adapter_folder(path: str | Path | None) -> bool:
    """A folder written by peft's `save_pretrained`: adapters, not a full model."""
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


def add_adapters(model: Any, config: ModelConfig, base_spec: str | Path) -> Any:
    """Wrap a freshly loaded model with new adapters as `config` says; only they train.

    `base_spec` (the model spec it was loaded from) is recorded in the adapter config, so a
    checkpoint finds its base again: a packaged name or hub id as given, a folder absolute."""
    from peft import LoraConfig, get_peft_model

    targets = config.lora_targets
    lora_config = LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets), task_type="CAUSAL_LM",
    )
    try:
        adapted = get_peft_model(model, lora_config)
    except ValueError as error:  # peft names the target modules it could not find
        raise ConfigError("model.lora_targets", f"{targets!r}: {error}") from None
    _check_head_untouched(adapted)
    adapted.peft_config["default"].base_model_name_or_path = _portable_spec(base_spec)
    return adapted


def prepare_student(model: Any, config: ModelConfig, checkpoint: Path | None) -> Any:
    """The trainable student: new adapters on a fresh model when LoRA is on, or the adapters
    a resumed checkpoint holds, refused when they disagree with the config."""
    resumed = is_lora(model)
    if not config.lora:
        if resumed:
            raise ConfigError("model.lora_rank", f"is 0, but the checkpoint {checkpoint} holds LoRA adapters; "
                              "resume with the run's own model.lora_rank")
        return model
    if checkpoint is not None and not resumed:
        raise ConfigError("model.lora_rank", f"is {config.lora_rank}, but the checkpoint {checkpoint} holds full "
                          "weights, not LoRA adapters; resume with model.lora_rank=0")
    if resumed:
        _check_same_settings(model, config, checkpoint)
    else:
        model = add_adapters(model, config, config.student)
    base = model.get_base_model()
    if getattr(base, "is_gradient_checkpointing", False):
        # Reentrant checkpointing backpropagates only into inputs that require grad; the
        # frozen embeddings' outputs do not, so the adapters would get no gradient.
        base.enable_input_require_grads()
    return model


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every weight of a plain model, the adapters of a LoRA one."""
    return [param for param in model.parameters() if param.requires_grad]


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Forward passes inside see the base weights (a `frozen` teacher); a no-op without LoRA."""
    if not is_lora(model):
        yield
        return
    with model.disable_adapter():
        yield


@torch.no_grad()
def served_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weights a server needs, under the base HF checkpoint's names.

    A plain model's parameters as they are (no copy). For a LoRA model, each adapted weight
    is W + scale * B @ A, formed in float32 beside the live module (no merge into it, so
    the trainer's module and its optimizer are untouched); `.base_layer` and the
    `base_model.model.` prefix drop out of the names, the adapter tensors are left out."""
    if not is_lora(model):
        return {name: param.detach() for name, param in model.named_parameters()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapter = model.active_adapter
    deltas = {
        f"{name}.weight": module.get_delta_weight(adapter)
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and adapter in module.lora_A and not module.merged
    }
    weights = {}
    for name, param in base.named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        hf_name = name.replace(".base_layer.", ".")
        delta = deltas.get(hf_name)
        weights[hf_name] = param.detach() if delta is None else (param.float() + delta.float()).to(param.dtype)
    return weights


def load_adapted(base_model: Any, folder: Path, *, trainable: bool) -> Any:
    """Adapters from `folder` on `base_model`: a trainable peft model (resuming a run), or,
    not trainable, a plain model with the adapters merged in (eval, diagnostics, serving)."""
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(base_model, folder, is_trainable=trainable)
    return adapted if trainable else adapted.merge_and_unload()


def adapter_base(folder: Path) -> Path:
    """The local folder of the base model an adapter folder was trained on (converted or
    downloaded as any model spec); a missing or unreadable base is refused naming both."""
    try:
        base = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as error:
        raise ModelError(f"LoRA adapter folder {folder}: cannot read {ADAPTER_CONFIG} ({error})") from None
    if not base:
        raise ModelError(f"LoRA adapter folder {folder}: {ADAPTER_CONFIG} names no base model "
                         "(base_model_name_or_path)")
    try:
        return resolve_model(base)
    except ModelError as error:
        raise ModelError(f"LoRA adapter folder {folder}: its base model {base!r} cannot be found: {error}") from None


def merge_checkpoint(checkpoint: Path, out: Path, dtype: str = "float32") -> Path:
    """Write a full HF model folder (weights with the adapters merged, tokenizer) from a LoRA
    checkpoint, loadable by transformers and vLLM without peft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not is_adapter_folder(checkpoint):
        raise ModelError(f"{checkpoint} is not a LoRA adapter folder (no {ADAPTER_CONFIG})")
    base = adapter_base(checkpoint)
    model = from_pretrained(AutoModelForCausalLM, base, dtype=getattr(torch, dtype))
    load_adapted(model, checkpoint, trainable=False).save_pretrained(out)
    tokenizer = from_pretrained(AutoTokenizer, base)
    tokenizer.save_pretrained(out)
    return Path(out)


def _check_head_untouched(model: Any) -> None:
    """Logprobs are computed from the output head's weight directly (selfopd.engines.scoring), so an
    adapter on the head, or on an input embedding tied to it, would be silently ignored."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    tied = getattr(base.config, "tie_word_embeddings", False)
    if isinstance(head, LoraLayer) or (tied and isinstance(embeddings, LoraLayer)):
        raise ConfigError("model.lora_targets", "must not adapt the output head (or an input embedding tied to it): "
                          "selfopd reads logprobs from the head's weight")


def _check_same_settings(model: Any, config: ModelConfig, checkpoint: Path | None) -> None:
    """A resumed run must train the adapters its checkpoint holds, with the same settings."""
    saved = model.peft_config[model.active_adapter]
    wanted = {"lora_rank": (saved.r, config.lora_rank), "lora_alpha": (saved.lora_alpha, config.lora_alpha),
              "lora_dropout": (saved.lora_dropout, config.lora_dropout)}
    if config.lora_targets != ("all-linear",) and not isinstance(saved.target_modules, str):
        wanted["lora_targets"] = (sorted(saved.target_modules), sorted(config.lora_targets))
    for key, (have, want) in wanted.items():
        if have != want:
            raise ConfigError(f"model.{key}", f"is {want!r}, but the checkpoint {checkpoint} was trained with "
                              f"{have!r}; resume with the run's own setting")


def _portable_spec(spec: str | Path) -> str:
    """A model spec that still names the same model from another directory."""
    text = str(spec)
    if text in PACKAGED_MODELS or not Path(text).expanduser().exists():
        return text
    return str(Path(text).expanduser().resolve())
