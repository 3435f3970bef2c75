"""Where the trainer computes and in which precision: `model.device`, `model.dtype`,
`model.attn_implementation`, resolved once into plain torch values.

Precision scheme for `model.dtype = "bfloat16"`: the trainable student keeps fp32 weights
(the master copy) and so fp32 gradients and fp32 AdamW state; forward and backward run
under bf16 autocast. Why not bf16 weights: bf16 keeps 8 significant bits, so an update
smaller than ~2^-9 of a weight rounds away: at lr 1e-6 an AdamW step (about lr in size)
changes almost no bf16 weight (measured: experiments/benchmarks/results/precision_memory.json). The
cost is 16 bytes per trained parameter (4 weight + 4 grad + 8 AdamW) instead of 12 with
bf16 weights and fp32 state; FSDP2 shards all of it over the ranks. Frozen teachers (no
optimizer, no updates) hold bf16 weights directly.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from selfopd.config.settings import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """The torch device `model.device` names here. 'auto' is the rank's local GPU when CUDA
    is there (`torchrun` gives each rank LOCAL_RANK), else the CPU."""
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", local_rank) if available else torch.device("cpu")
    if not available:
        raise ConfigError("model.device", f"{spec!r}: no CUDA device is visible here (torch "
                          f"{torch.__version__}, CUDA_VISIBLE_DEVICES as set); use 'cpu' or 'auto'")
    index = int(spec.split(":")[1]) if ":" in spec else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError("model.device", f"{spec!r}: GPU {index} does not exist; {torch.cuda.device_count()} "
                          "visible (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return torch.device("cuda", index)


def attn_implementation(spec: str, device: torch.device, dtype: str = "float32") -> str:
    """The transformers attention kernel: 'auto' is flash attention 2 for a bf16 run on a GPU
    with the flash-attn package installed, else PyTorch's sdpa (what transformers picks by
    default). Flash kernels take fp16/bf16 only: an fp32 run's models and engines compute in
    fp32, so flash there is refused rather than failing at the first forward."""
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    if spec == "auto":
        flash = device.type == "cuda" and dtype == "bfloat16" and flash_installed
        return "flash_attention_2" if flash else "sdpa"
    if spec.startswith("flash_attention"):
        if device.type != "cuda":
            raise ConfigError("model.attn_implementation", f"{spec!r} runs on CUDA only; model.device is {device}")
        if dtype == "float32":
            raise ConfigError("model.attn_implementation", f"{spec!r} computes in fp16/bf16 only and model.dtype is "
                              "'float32': set model.dtype = 'bfloat16' or use 'sdpa'")
        package = "flash_attn_interface" if spec == "flash_attention_3" else "flash_attn"
        if importlib.util.find_spec(package) is None:
            raise ConfigError("model.attn_implementation", f"{spec!r} needs the {package} package, which is not "
                              "installed (pip install flash-attn --no-build-isolation); or use 'sdpa'")
    return spec


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` this process's current one, whichever GPU it is. NCCL endpoints
    (vLLM's weight transfer, the process group) bind the current device, and tensors sent to
    "cuda" land there: left at GPU 0, a trainer on cuda:1 would put its end of the weight sync
    on GPU 0, where a server may be ('Duplicate GPU detected')."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def autocast(device: torch.device, dtype: str, *, cache: bool = False) -> contextlib.AbstractContextManager:
    """bf16 autocast around one forward pass (or one `generate`) for `model.dtype =
    'bfloat16'`; nothing for fp32.

    Scoped per forward, never around a whole step: autocast keeps the bf16 copy of each fp32
    weight made by the first forward of the outermost region, and neither a backward, an
    optimizer step nor FSDP's re-gathering invalidates it. A step-wide region gave FSDP2
    layers no gradient after a no-grad forward, wrong sums over micro-batches, a probe that
    read the previous step's weights, and a bf16 copy of every layer held all step.
    `cache=True` only where the weights cannot change inside the region (one `generate`, whose
    every token reuses the casts), and only as the outermost region, whose exit drops the
    cache; inside another autocast region it does not cache."""
    if dtype == "float32":
        return contextlib.nullcontext()
    outermost = not torch.is_autocast_enabled(device.type)
    return torch.autocast(device.type, dtype=DTYPES[dtype], cache_enabled=cache and outermost)


def full_precision(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off: the output head and log-softmax run in the inputs' precision (fp32 or more),
    where bf16 logits would be off by ~0.1 nats at logits of ~30."""
    return torch.autocast(device_type, enabled=False)


def model_device(model: Any) -> torch.device:
    """The device a model's (possibly sharded) parameters live on: where its inputs go."""
    return next(model.parameters()).device

