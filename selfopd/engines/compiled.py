"""Where selfopd uses torch.compile: the student's decode step and its decoder layers in training.

Both are settings (engine.compiled_sampling, model.compile_layers), off by default: a compile costs
tens of seconds on a CPU before it pays, and what it gains there was measured
(docs/results/benchmarks.md, "Compiled sampling and compiled layers"). The compiled code computes
what eager code does; fusion may reorder fp32 sums.
"""

from __future__ import annotations

import types
from typing import Any

import torch

# With compiled decoding, prompts are left-padded to a multiple of this many tokens: the static
# KV cache then has one length for every batch whose prompts differ by a few tokens, and those
# batches reuse one compiled decode step (padded positions are masked, as in any batch).
COMPILED_WIDTH_STEP = 64


def compiled_width(longest_prompt: int) -> int:
    return -(-longest_prompt // COMPILED_WIDTH_STEP) * COMPILED_WIDTH_STEP


def compiled_decoding(device: torch.device) -> dict[str, Any]:
    """generate's options for a static KV cache and a compiled decode step. transformers compiles the
    model's forward once per shape (batch rows, cache length), keeps it on the model and reuses it;
    the weights are the compiled step's inputs, so optimizer steps reach it. On a GPU the step is
    replayed as a CUDA graph ('reduce-overhead'). generate compiles only on accelerators unless told
    to compile on every device."""
    from transformers import CompileConfig

    config = CompileConfig(dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def compile_decoder_layers(model: Any) -> int:
    """Compile the training forward (and so backward) of every decoder layer of `model`; returns how
    many (0: none found, nothing compiled). Regional compilation: the layers run the same code, so
    without a KV cache one compiled graph, lengths dynamic, serves them all, and a step compiles in
    seconds, not the whole model's minutes. With the shared prompt's cache (samples_per_prompt > 1)
    a layer reads the cache at its own index, and each layer gets its graph (traced again; the
    generated code comes from inductor's cache): the recompile limit is raised to allow that. Only
    forwards with gradients are compiled; sampling and scoring run as they did. Layers are
    transformers' `GradientCheckpointingLayer`s, found under LoRA adapters and a vision-language
    model's text model alike."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    for layer in layers:
        layer.forward = types.MethodType(_layer_forward, layer)  # shadows the class's
    global _recompile_limit
    _recompile_limit = max(_recompile_limit, 4 * len(layers) + 8)  # a graph per layer, with and without cache
    return len(layers)


def _layer_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(layer).forward
    if not torch.is_grad_enabled():
        return forward(layer, *args, **kwargs)
    if forward not in _compiled:  # one compiled function per layer class: each keeps its own graphs
        _compiled[forward] = torch.compile(forward, dynamic=True)
    with torch._dynamo.config.patch(recompile_limit=_recompile_limit,
                                    accumulated_recompile_limit=max(256, 4 * _recompile_limit)):
        return _compiled[forward](layer, *args, **kwargs)


_compiled: dict[Any, Any] = {}
_recompile_limit = 8  # torch's default; raised for the deepest model compiled
