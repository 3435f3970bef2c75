"""Chunked autograd kernels: per-position functions of the next-token distribution, formed
from final hidden states and an unembedding matrix without ever holding the (B, T, V) logits.

A full fp32 log-softmax of a long sequence over a large vocabulary is what runs out of memory
first. `chunked_on_real_positions` forms a window of W positions' logits, applies a
`ChunkFunction` to them and drops them; backward recomputes the window and applies the
function's analytic gradient straight to hidden states and weight. Two users: the logprobs of
given tokens (`token_logprobs_from_hidden`, here: every engine scores with it) and the
whole-distribution divergences of the loss (`selfopd.training.divergences`). Pinned against
float64 brute force and `torch.autograd.gradcheck` in tests/engines/test_kernels.py and
tests/training/test_divergences.py.

Shape letters: B sequences, T positions, V vocabulary, H hidden size, W positions in one
window (chunk), N real (masked-in) positions. Masked positions (mask False: padding) give
exactly 0 and exactly zero gradient, whatever their inputs hold, and cost nothing: the
kernels gather the N real positions first and form logits for those only (a window holds
chunk_size x B of them, as many logits as a padded (B, chunk_size) one).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from selfopd.core.devices import full_precision

# (the window's logprobs (B, W, V) in the compute dtype, the window, its mask (B, W), whether the
# gradient is needed) -> (the values (B, W), d values / d logits (B, W, V) or None). It may
# overwrite the logprobs it is given.
ChunkFunction = Callable[[Tensor, slice, Tensor, bool], tuple[Tensor, Tensor | None]]


def window_logprobs(hidden_BWH: Tensor, weight_VH: Tensor, mask_BW: Tensor, dtype: torch.dtype) -> Tensor:
    """log_softmax(hidden @ weight.T), the matmul and the softmax in `dtype` (fp32 or fp64)
    even inside a bf16 autocast region; masked positions read zeros (a uniform
    distribution), so inf or nan hidden states there never reach a value or gradient."""
    hidden_BWH = torch.where(mask_BW[..., None], hidden_BWH, 0.0)
    with full_precision(hidden_BWH.device.type):
        return torch.log_softmax(hidden_BWH.to(dtype) @ weight_VH.to(dtype).T, dim=-1)


class _ChunkedDivergence(torch.autograd.Function):
    """values_BT = J(softmax(hidden @ weight.T), teacher) per position, chunk by chunk.

    Nothing of size V but one window outlives a chunk: forward keeps its inputs and, when a
    gradient will be asked for, the last window's dJ/dlogits; backward uses that window first
    and frees it, then recomputes each other chunk and applies its analytic dJ/dlogits straight
    to hidden and weight. Autograd through the same arithmetic would keep several (B, T, V)
    tensors (checkpointing per chunk still keeps several (B, W, V) ones while recomputing);
    this way a chunk peaks at about three (B, W, V) tensors (four for JSD), and when one window
    holds every position (completions of at most `chunk_size` tokens on average), backward
    forms no logits at all.
    """

    @staticmethod
    def forward(ctx, hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_divergence: ChunkFunction, chunk_size: int,
                keep_last: bool) -> Tensor:
        with full_precision(hidden_BTH.device.type):
            return _ChunkedDivergence._forward(ctx, hidden_BTH, weight_VH, mask_BT, chunk_divergence, chunk_size, keep_last)

    @staticmethod
    def _forward(ctx, hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_divergence: ChunkFunction, chunk_size: int,
                 keep_last: bool) -> Tensor:
        dtype = torch.promote_types(torch.promote_types(hidden_BTH.dtype, weight_VH.dtype), torch.float32)
        values_BT = torch.zeros(mask_BT.shape, dtype=dtype, device=hidden_BTH.device)
        ctx.last_grad = None
        for start in range(0, hidden_BTH.shape[1], chunk_size):
            window = slice(start, start + chunk_size)
            mask_BW = mask_BT[:, window]
            # The last window's d values / d logits, when backward will want it, are formed now from the same
            # logprobs (the values do not depend on it) and kept: backward then does not form that window's
            # logits again, the student's or a teacher's (the whole head when one window holds every position).
            # Kept is one window, freed before backward forms any other: the peak is backward's as before.
            last = keep_last and start + chunk_size >= hidden_BTH.shape[1]
            # Passed without a name, so the chunk can free the student's logprobs early.
            chunk_BW, ctx.last_grad = chunk_divergence(window_logprobs(hidden_BTH[:, window], weight_VH, mask_BW, dtype), window, mask_BW, last)
            values_BT[:, window] = torch.where(mask_BW, chunk_BW, 0.0)
        ctx.save_for_backward(hidden_BTH, weight_VH, mask_BT)
        ctx.chunk_divergence, ctx.chunk_size, ctx.dtype = chunk_divergence, chunk_size, dtype
        return values_BT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BT: Tensor):
        with full_precision(grad_BT.device.type):
            return _ChunkedDivergence._backward(ctx, grad_BT)

    @staticmethod
    def _backward(ctx, grad_BT: Tensor):
        hidden_BTH, weight_VH, mask_BT = ctx.saved_tensors
        grad_hidden_BTH = torch.zeros_like(hidden_BTH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=ctx.dtype, device=weight_VH.device) if ctx.needs_input_grad[1] else None
        starts = list(range(0, hidden_BTH.shape[1], ctx.chunk_size))
        kept, ctx.last_grad = ctx.last_grad, None  # a second backward (retain_graph) forms it again
        for start in ([starts[-1]] + starts[:-1]) if kept is not None else starts:  # the kept window first, freed first
            window = slice(start, start + ctx.chunk_size)
            mask_BW = mask_BT[:, window]
            if kept is not None:
                grad_logits_BWV, kept = kept, None
            else:
                _, grad_logits_BWV = ctx.chunk_divergence(window_logprobs(hidden_BTH[:, window], weight_VH, mask_BW, ctx.dtype), window, mask_BW, True)
            grad_logits_BWV.mul_(torch.where(mask_BW, grad_BT[:, window].to(ctx.dtype), 0.0)[..., None])
            # In the head's precision (`ctx.dtype`), whatever the dtype of hidden states or weight.
            if grad_hidden_BTH is not None:
                grad_hidden_BTH[:, window] = grad_logits_BWV @ weight_VH.to(ctx.dtype)
            if grad_weight_VH is not None:
                hidden_NH = torch.where(mask_BW[..., None], hidden_BTH[:, window], 0.0).flatten(0, 1)
                grad_weight_VH += grad_logits_BWV.flatten(0, 1).T @ hidden_NH.to(ctx.dtype)
            del grad_logits_BWV
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_BTH, grad_weight_VH, None, None, None, None


def check_hidden_and_head(hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_size: int) -> None:
    if hidden_BTH.ndim != 3 or weight_VH.ndim != 2 or hidden_BTH.shape[-1] != weight_VH.shape[-1] or mask_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(
            f"need student hidden (B, T, H), weight (V, H) and mask (B, T), got "
            f"{tuple(hidden_BTH.shape)}, {tuple(weight_VH.shape)} and {tuple(mask_BT.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def chunked_on_real_positions(hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_divergence: ChunkFunction,
                             chunk_size: int, keep_last: bool = True) -> Tensor:
    """`_ChunkedDivergence` over the masked-in positions only, back in (B, T) with exactly 0 (and
    zero gradient) elsewhere: padding never costs a (V, H) matmul. `chunk_divergence` reads
    per-position inputs compacted alike (`compact`). A window holds chunk_size x B real
    positions, as many logits as a (B, chunk_size) window of the padded layout. `keep_last`: when
    differentiated, keep the last window's gradient from forward to backward (`_ChunkedDivergence`);
    False where another loss window is formed before backward, which would then peak one window higher."""
    differentiated = keep_last and torch.is_grad_enabled() and (hidden_BTH.requires_grad or weight_VH.requires_grad)
    values_1N = _ChunkedDivergence.apply(hidden_BTH[mask_BT][None], weight_VH, _all_real(mask_BT),
                                         chunk_divergence, chunk_size * mask_BT.shape[0], differentiated)
    return values_1N.new_zeros(mask_BT.shape).index_put(torch.nonzero(mask_BT, as_tuple=True), values_1N[0])


def compact(mask_BT: Tensor, tensor_BT: Tensor) -> Tensor:
    """A per-position tensor (B, T, ...) at the masked-in positions, as (1, N, ...)."""
    return tensor_BT[mask_BT][None]


def _all_real(mask_BT: Tensor) -> Tensor:
    return torch.ones(1, int(mask_BT.sum()), dtype=torch.bool, device=mask_BT.device)


def token_logprobs_from_hidden(
    hidden_BTH: Tensor, lm_head_weight_VH: Tensor, tokens_BT: Tensor, chunk_size: int = 256,
    mask_BT: Tensor | None = None, keep_last: bool = True,
) -> Tensor:
    """Like `token_logprobs`, from final hidden states and the unembedding matrix.

    Skips the (B, T, V) logits tensor altogether: each chunk's logits are formed, scored and
    dropped, and recomputed in backward, where the analytic gradient onehot - softmax goes
    straight to hidden and weight (the chunked machinery the loss's divergences share: about
    three (B, W, V) tensors at a time, where per-chunk checkpointing kept about five).
    Only for a plain linear head (no bias, logit scaling or soft-capping), as in
    Llama/Qwen/SmolLM2; `hidden_BTH` is the output of the final norm. The head's matmul and
    the log-softmax run in at least fp32 with autocast off, inside a bf16 region too: bf16
    logits of ~30 are off by ~0.1 nats. `mask_BT` (optional): positions outside it get 0 and
    cost nothing (padding). `keep_last` as in `chunked_on_real_positions`.
    """
    if hidden_BTH.ndim != 3 or tokens_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(f"need hidden (B, T, H) and tokens (B, T), got {tuple(hidden_BTH.shape)} and {tuple(tokens_BT.shape)}")
    mask_BT = torch.ones(tokens_BT.shape, dtype=torch.bool, device=tokens_BT.device) if mask_BT is None else mask_BT.bool()
    check_hidden_and_head(hidden_BTH, lm_head_weight_VH, mask_BT, chunk_size)
    tokens_BT = compact(mask_BT, tokens_BT.long())

    def chunk_token_logprob(student_lp_BWV: Tensor, window: slice, mask_BW: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        tokens_BW1 = tokens_BT[:, window, None]
        values_BW = student_lp_BWV.gather(-1, tokens_BW1).squeeze(-1)
        if not need_grad:
            return values_BW, None
        grad_BWV = student_lp_BWV.exp_().neg_()  # d log s_y / d logits = onehot(y) - s
        return values_BW, grad_BWV.scatter_add_(-1, tokens_BW1, torch.ones_like(tokens_BW1, dtype=grad_BWV.dtype))

    return chunked_on_real_positions(hidden_BTH, lm_head_weight_VH, mask_BT, chunk_token_logprob, chunk_size, keep_last)


