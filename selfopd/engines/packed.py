"""Sampling a few rows at a time on a CPU through MKL's packed matrix products.

A decode step multiplies a handful of rows (the batch) by every weight matrix of the model, so
it is bound by reading the weights. Plain sgemm repacks a weight into its panel layout on every
call; MKL can pack it once and reuse the packed copy (`cblas_sgemm_pack`, which PyTorch exposes
as `torch.ops.mkl._mkl_linear`). While `packed_linears(model, rows)` is entered, every
`nn.Linear` of the model computes from a copy packed for `rows` rows (a product of another row
count, such as the prefill of the prompts, falls back to plain sgemm), so the weights must not
change inside it: one sampling call. On the packaged SmolLM2 with 8 rows on 2 cores the model's
linear layers took 32 ms a pass instead of 50 ms, and a sampling call of 8 x 64 tokens 4.2 s
instead of 5.3 s (experiments/benchmarks/vs_trl.py measures it per step). The products differ
from plain sgemm only in the order of summation: sampled tokens' logprobs within 3e-5 of the
trainer's (tests/engines/test_local.py).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch


def packing_problem(model: Any, precision: str) -> str | None:
    """Why `model` cannot sample through packed products (None: it can): fp32 weights and compute,
    on a CPU, with MKL."""
    if not torch.backends.mkl.is_available():
        return "this torch build has no MKL"
    if precision != "float32":
        return f"model.dtype is {precision!r}; MKL's packed products are fp32"
    weights = {(p.device.type, p.dtype) for p in model.parameters()}
    if weights != {("cpu", torch.float32)}:
        return f"the model's weights are {sorted(f'{d} {t}' for d, t in weights)}, not fp32 on the CPU"
    return None


@torch.library.custom_op("selfopd::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: int) -> torch.Tensor:
    """MKL's packed product as an operator torch.compile calls as it is: inductor's own lowering of
    `_mkl_linear` takes only weights frozen into the graph, and these change every training step."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Eager calls skip the operator's dispatch (about 10 us a product, 13,000 products a sampling call).
    linear = packed_linear if torch.compiler.is_compiling() else torch.ops.mkl._mkl_linear
    return linear(x, module.packed_weight, module.weight, module.bias, module.packed_rows)


@contextlib.contextmanager
def packed_linears(model: Any, rows: int) -> Iterator[None]:
    """Every `nn.Linear` of `model` computes through a copy of its weight packed for `rows` rows
    until the block ends; the modules are then as they were. The copy is a (non-persistent) buffer
    of the module, so a compiled decode step (`LocalEngine(compiled=True)`) takes it as an input
    and does not compile again when the next call packs the weights anew."""
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    try:
        for module in linears:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), rows)
            module.register_buffer("packed_weight", packed, persistent=False)
            module.packed_rows = rows
            module.forward = types.MethodType(_packed_forward, module)  # shadows the class's
        yield
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("packed_rows", None)
            module._buffers.pop("packed_weight", None)
