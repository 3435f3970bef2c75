"""The loss's whole-distribution divergences: the student's next-token distributions against a
teacher's, chunked so that no (B, T, V) tensor is ever held (`selfopd.engines.kernels`).

Sampled-token OPD (`selfopd.training.loss`) sees one token per position. These compare whole
next-token distributions: the student's (from its final hidden states and unembedding matrix)
with a teacher's, given in full (logits, or hidden states and unembedding of an in-process
teacher) or as its top-k (what an engine such as vLLM returns). Each returns per-token values
(B, T), 0 on masked positions; `selfopd.training.loss` reduces them. Only the student gets a
gradient; the teacher is always detached. Pinned against float64 brute force and gradcheck in
tests/training/test_divergences.py. Shape letters as in `selfopd.engines.kernels`, and K the
teacher's top-k entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from selfopd.engines.kernels import check_hidden_and_head, chunked_on_real_positions, compact, window_logprobs

FullDivergence = Literal["reverse_kl", "forward_kl", "jsd"]


def _kl_consuming(p_lp_BWV: Tensor, q_lp_BWV: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(KL(p || q) (B, W), p, the terms p (log p - log q)), the terms written over p_lp.

    A term is exactly 0 where p = 0, even where q = 0 too (0 * inf, -inf + inf); q = 0
    where p > 0 gives inf, as it should.
    """
    p_BWV = p_lp_BWV.exp()
    terms_BWV = p_lp_BWV.sub_(q_lp_BWV).mul_(p_BWV).masked_fill_(p_BWV == 0, 0.0)
    return terms_BWV.sum(-1), p_BWV, terms_BWV


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate both for x near 0 and for x very negative."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def full_vocab_divergence(
    student_hidden_BTH: Tensor,
    student_weight_VH: Tensor,
    mask_BT: Tensor,
    *,
    teacher_logits_BTV: Tensor | None = None,
    teacher_hidden_BTH: Tensor | None = None,
    teacher_weight_VH: Tensor | None = None,
    divergence: FullDivergence = "reverse_kl",
    beta: float = 0.5,
    chunk_size: int = 256,
) -> Tensor:
    """Per-token divergence (B, T) between the student's and the teacher's full next-token
    distributions, `chunk_size` positions at a time; 0 on masked positions.

    Exact where sampled-token OPD is a one-sample estimate, at the price of a teacher in
    process. The teacher is given either as logits (B, T, V) or as final hidden states and
    unembedding (like the student; then it never holds (B, T, V) either), and is detached.
    With s = student, t = teacher:
      "reverse_kl"  KL(s || t) = sum_v s_v (log s_v - log t_v), mode-seeking; what
                    sampled-token OPD estimates;
      "forward_kl"  KL(t || s), mass-covering (supervised distillation on the student's states);
      "jsd"         generalised JSD(beta) of GKD (Agarwal et al. 2024), as TRL's
                    `generalized_jsd_loss` (and OPSD's, which copies it): with
                    m = beta t + (1 - beta) s, beta KL(t || m) + (1 - beta) KL(s || m). It tends
                    to 0 at both ends, so, as in TRL, beta = 0 is defined as forward KL and
                    beta = 1 as reverse KL (the limits of JSD / beta and JSD / (1 - beta)).
    Computed in at least fp32 (fp64 stays fp64), the heads' matmuls included, with autocast
    off as in `token_logprobs_from_hidden`. A teacher logprob of -inf where the student has mass
    makes the reverse KL inf, as it should.
    """
    divergence, teacher_logprobs = _setup(student_hidden_BTH, student_weight_VH, mask_BT, teacher_logits_BTV,
                                          teacher_hidden_BTH, teacher_weight_VH, divergence, beta, chunk_size)
    mask_BT = mask_BT.bool()

    def chunk_divergence(student_lp_BWV: Tensor, window: slice, mask_BW: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        teacher_lp_BWV = teacher_logprobs(window, mask_BW, student_lp_BWV.dtype)
        if divergence == "reverse_kl":
            # dJ/dlogits_v = s_v (log s_v - log t_v - J) = term_v - s_v J
            values_BW, student_BWV, terms_BWV = _kl_consuming(student_lp_BWV, teacher_lp_BWV)
            del student_lp_BWV, teacher_lp_BWV
            return values_BW, (terms_BWV.sub_(student_BWV.mul_(values_BW[..., None])) if need_grad else None)
        if divergence == "forward_kl":
            # dJ/dlogits_v = s_v - t_v
            values_BW, teacher_BWV = _kl_consuming(teacher_lp_BWV, student_lp_BWV)[:2]
            del teacher_lp_BWV
            return values_BW, (student_lp_BWV.exp_().sub_(teacher_BWV) if need_grad else None)
        # jsd: log m = logaddexp(log s + log(1 - beta), log t + log beta), without a temporary
        log_m_BWV = student_lp_BWV + math.log1p(-beta)
        torch.logaddexp(log_m_BWV, teacher_lp_BWV.add_(math.log(beta)), out=log_m_BWV)
        teacher_part_BW = _kl_consuming(teacher_lp_BWV.sub_(math.log(beta)), log_m_BWV)[0]
        del teacher_lp_BWV
        student_part_BW, student_BWV, terms_BWV = _kl_consuming(student_lp_BWV, log_m_BWV)
        del student_lp_BWV, log_m_BWV
        values_BW = beta * teacher_part_BW + (1 - beta) * student_part_BW
        # dJ/ds_v = (1 - beta)(log s_v - log m_v), so
        # dJ/dlogits_v = (1 - beta) s_v (log s_v - log m_v - KL(s || m)) = (1 - beta)(term_v - s_v KL(s || m))
        return values_BW, (terms_BWV.sub_(student_BWV.mul_(student_part_BW[..., None])).mul_(1 - beta) if need_grad else None)

    return chunked_on_real_positions(student_hidden_BTH, student_weight_VH, mask_BT, chunk_divergence, chunk_size)


@dataclass(frozen=True)
class EntryClipped:
    """A full-vocabulary divergence whose per-entry terms were capped (`entry_clipped_divergence`),
    each (B, T), 0 on masked positions."""

    values_BT: Tensor  # sum_v min(d_v, c): what the loss trains, differentiable in the student
    unclipped_BT: Tensor  # sum_v d_v, the divergence itself, detached
    clipped_BT: Tensor  # bool: positions where at least one entry was capped


def entry_clipped_divergence(
    student_hidden_BTH: Tensor,
    student_weight_VH: Tensor,
    mask_BT: Tensor,
    clip: float,
    *,
    teacher_logits_BTV: Tensor | None = None,
    teacher_hidden_BTH: Tensor | None = None,
    teacher_weight_VH: Tensor | None = None,
    divergence: FullDivergence = "reverse_kl",
    beta: float = 0.5,
    chunk_size: int = 256,
) -> EntryClipped:
    """`full_vocab_divergence` with each vocabulary entry's term capped at `clip` before the sum:
    sum_v min(d_v, c), where d_v is s_v (log s_v - log t_v) (reverse KL), t_v (log t_v - log s_v)
    (forward KL) or beta t_v (log t_v - log m_v) + (1 - beta) s_v (log s_v - log m_v) (JSD; beta 0
    and 1 as forward and reverse KL). This is OPSD's `jsd_token_clip` (`jsd.clamp(max=token_clip)`
    on the (B, T, V) terms of TRL's generalised JSD, then the sum): a capped entry gives no
    gradient, and since a KL's terms below the cap may be negative, its sum can be below 0 (each term
    of a JSD with 0 < beta < 1 is >= 0, by the log-sum inequality: its sum stays in [0, V c]).

    Gradient: every term has d d_v / d logits_w = g_v (1[v = w] - s_w), with g_v = -t_v (forward),
    d_v + s_v (reverse), (1 - beta) s_v (log s_v - log m_v) (JSD); so with a_v = g_v where
    d_v <= c (torch's clamp passes the gradient at equality) and 0 elsewhere,
    dJ/dlogits_w = a_w - s_w sum_v a_v.
    """
    if not clip > 0:
        raise ValueError(f"the entry clip must be > 0, got {clip}")
    divergence, teacher_logprobs = _setup(student_hidden_BTH, student_weight_VH, mask_BT, teacher_logits_BTV,
                                          teacher_hidden_BTH, teacher_weight_VH, divergence, beta, chunk_size)
    mask_BT = mask_BT.bool()
    dtype = torch.promote_types(torch.promote_types(student_hidden_BTH.dtype, student_weight_VH.dtype), torch.float32)
    # Written by window (the compacted positions' windows), the same values again when backward recomputes one.
    unclipped_1N = torch.zeros(1, int(mask_BT.sum()), dtype=dtype, device=student_hidden_BTH.device)
    clipped_1N = torch.zeros(unclipped_1N.shape, dtype=torch.bool, device=student_hidden_BTH.device)

    def chunk_divergence(student_lp_BWV: Tensor, window: slice, mask_BW: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        # The terms d_v and slopes g_v, in place over the logprobs where they are not needed again:
        # about three (B, W, V) tensors at a time (four for JSD), as `full_vocab_divergence`.
        teacher_lp_BWV = teacher_logprobs(window, mask_BW, student_lp_BWV.dtype)
        if divergence == "forward_kl":
            teacher_BWV = teacher_lp_BWV.exp()
            terms_BWV = teacher_lp_BWV.sub_(student_lp_BWV).mul_(teacher_BWV).masked_fill_(teacher_BWV == 0, 0.0)
            slope_BWV = teacher_BWV.neg_()
            student_BWV = student_lp_BWV.exp_()
        elif divergence == "reverse_kl":
            student_BWV = student_lp_BWV.exp()
            terms_BWV = student_lp_BWV.sub_(teacher_lp_BWV).mul_(student_BWV).masked_fill_(student_BWV == 0, 0.0)
            del teacher_lp_BWV
            slope_BWV = terms_BWV + student_BWV if need_grad else None
        else:  # jsd: log m = logaddexp(log s + log(1 - beta), log t + log beta)
            log_m_BWV = student_lp_BWV + math.log1p(-beta)
            torch.logaddexp(log_m_BWV, teacher_lp_BWV.add_(math.log(beta)), out=log_m_BWV)
            teacher_lp_BWV.sub_(math.log(beta))
            teacher_BWV = teacher_lp_BWV.exp()
            terms_BWV = teacher_lp_BWV.sub_(log_m_BWV).mul_(teacher_BWV).masked_fill_(teacher_BWV == 0, 0.0).mul_(beta)
            del teacher_BWV
            student_BWV = student_lp_BWV.exp()
            slope_BWV = student_lp_BWV.sub_(log_m_BWV).mul_(student_BWV).masked_fill_(student_BWV == 0, 0.0).mul_(1 - beta)
            del log_m_BWV
            terms_BWV += slope_BWV
        kept_BWV = terms_BWV <= clip
        unclipped_1N[:, window] = terms_BWV.sum(-1)
        clipped_1N[:, window] = ~kept_BWV.all(-1)
        values_BW = terms_BWV.clamp_(max=clip).sum(-1)
        del terms_BWV
        if not need_grad:
            return values_BW, None
        slope_BWV.masked_fill_(~kept_BWV, 0.0)  # a capped entry (an inf term included) is a constant
        return values_BW, slope_BWV.sub_(student_BWV.mul_(slope_BWV.sum(-1, keepdim=True)))

    values_BT = chunked_on_real_positions(student_hidden_BTH, student_weight_VH, mask_BT, chunk_divergence, chunk_size)
    where = torch.nonzero(mask_BT, as_tuple=True)
    return EntryClipped(values_BT, unclipped_1N.new_zeros(mask_BT.shape).index_put(where, unclipped_1N[0]),
                        clipped_1N.new_zeros(mask_BT.shape).index_put(where, clipped_1N[0]))


TeacherLogprobs = Callable[[slice, Tensor, torch.dtype], Tensor]


def _setup(student_hidden_BTH: Tensor, student_weight_VH: Tensor, mask_BT: Tensor, teacher_logits_BTV: Tensor | None,
           teacher_hidden_BTH: Tensor | None, teacher_weight_VH: Tensor | None, divergence: str, beta: float,
           chunk_size: int) -> tuple[str, TeacherLogprobs]:
    """The inputs of a full-vocabulary divergence checked: (the divergence, jsd at beta 0 or 1 named as
    the KL it is defined as, the teacher's logprobs of a window of the compacted positions)."""
    check_hidden_and_head(student_hidden_BTH, student_weight_VH, mask_BT, chunk_size)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    if divergence not in ("reverse_kl", "forward_kl", "jsd"):
        raise ValueError(f"divergence must be 'reverse_kl', 'forward_kl' or 'jsd', got {divergence!r}")
    B, T, _ = student_hidden_BTH.shape
    V = student_weight_VH.shape[0]
    mask_BT = mask_BT.bool()
    if teacher_logits_BTV is not None and teacher_hidden_BTH is None and teacher_weight_VH is None:
        if teacher_logits_BTV.shape != (B, T, V):
            raise ValueError(f"teacher logits have shape {tuple(teacher_logits_BTV.shape)}, need {(B, T, V)}")
        logits_1NV = compact(mask_BT, teacher_logits_BTV.detach())

        def from_logits(window: slice, mask_BW: Tensor, dtype: torch.dtype) -> Tensor:
            return torch.log_softmax(torch.where(mask_BW[..., None], logits_1NV[:, window], 0.0).to(dtype), dim=-1)

        return divergence, from_logits
    if teacher_logits_BTV is None and teacher_hidden_BTH is not None and teacher_weight_VH is not None:
        if teacher_hidden_BTH.shape[:2] != (B, T) or teacher_weight_VH.shape[0] != V or teacher_hidden_BTH.shape[-1] != teacher_weight_VH.shape[-1]:
            raise ValueError(f"teacher hidden {tuple(teacher_hidden_BTH.shape)} and weight {tuple(teacher_weight_VH.shape)} do not fit {(B, T)} and V = {V}")
        hidden_1NH, weight_VH = compact(mask_BT, teacher_hidden_BTH.detach()), teacher_weight_VH.detach()

        def from_states(window: slice, mask_BW: Tensor, dtype: torch.dtype) -> Tensor:
            return window_logprobs(hidden_1NH[:, window], weight_VH, mask_BW, dtype)

        return divergence, from_states
    raise ValueError("give the teacher either as teacher_logits_BTV or as teacher_hidden_BTH and teacher_weight_VH")


def topk_tail_logprob(topk_logprobs_BTK: Tensor, floor: float = 0.0) -> Tensor:
    """log(1 - sum_k exp(topk_logprobs)): the log of the mass outside the top-k, per position.

    Computed in float64, as log1mexp(logsumexp): 1 minus a sum close to 1 is where fp32
    loses everything. A top-k that sums to 1 or more (the engine's rounding, at a confident
    position) has no tail: -inf, or log(floor) when floor > 0. Returned in at least fp32.
    """
    lse_BT = torch.logsumexp(topk_logprobs_BTK.double(), dim=-1).clamp(max=0.0)
    tail_BT = _log1mexp(lse_BT)
    if floor > 0:
        tail_BT = tail_BT.clamp(min=math.log(floor))
    return tail_BT.to(torch.promote_types(topk_logprobs_BTK.dtype, torch.float32))


def topk_reverse_kl(
    student_hidden_BTH: Tensor,
    student_weight_VH: Tensor,
    topk_ids_BTK: Tensor,
    topk_logprobs_BTK: Tensor,
    mask_BT: Tensor,
    *,
    tail_floor: float = 1e-6,
    chunk_size: int = 256,
) -> Tensor:
    """Per-token reverse KL (B, T) over K + 1 buckets: the teacher's top-k ids and a tail.

    What a remote teacher can afford to send is its top-k (`TokenScores.topk_ids`,
    `topk_logprobs`). Comparing only those K entries is not a divergence (both sides miss
    mass, and the student can put all its mass elsewhere at no cost); lumping the rest of
    each distribution into one tail bucket makes it a proper KL between two (K+1)-point
    distributions, 0 iff they agree on the buckets and never above the full reverse KL.
    The student's tail is summed directly over the ids outside the top-k (no 1 - sum); the
    teacher's is 1 - sum exp(top-k) (`topk_tail_logprob`), floored at `tail_floor`: engine
    logprobs are rounded, so at a confident position that difference can come out 0, and
    any student tail mass there would make the KL infinite. tail_floor = 0 is the exact
    definition. The K ids must be distinct per position; with K = V the tail is empty and
    this is the full reverse KL. Masked positions may hold any ids and logprobs.
    """
    check_hidden_and_head(student_hidden_BTH, student_weight_VH, mask_BT, chunk_size)
    K, V = topk_ids_BTK.shape[-1], student_weight_VH.shape[0]
    if topk_ids_BTK.shape != (*mask_BT.shape, K) or topk_logprobs_BTK.shape != topk_ids_BTK.shape or not 1 <= K <= V:
        raise ValueError(
            f"need top-k ids and logprobs (B, T, K) with 1 <= K <= V = {V}, got {tuple(topk_ids_BTK.shape)} and {tuple(topk_logprobs_BTK.shape)}"
        )
    mask_BT = mask_BT.bool()
    ids_BTK = compact(mask_BT, topk_ids_BTK.long())  # masked positions may hold anything: they are dropped
    teacher_lp_BTK = compact(mask_BT, topk_logprobs_BTK.detach())
    teacher_tail_BT = topk_tail_logprob(teacher_lp_BTK, tail_floor)

    def chunk_divergence(student_lp_BWV: Tensor, window: slice, mask_BW: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        ids_BWK = ids_BTK[:, window]
        top_BWK = student_lp_BWV.gather(-1, ids_BWK)
        rest_BWV = student_lp_BWV.exp_().scatter_(-1, ids_BWK, 0.0)  # student probabilities outside the top-k
        del student_lp_BWV
        student_buckets = torch.cat([top_BWK, rest_BWV.sum(-1, keepdim=True).log()], dim=-1)  # tail -inf when K = V
        student_buckets -= student_buckets.logsumexp(-1, keepdim=True)  # sum exactly 1: fp32 log_softmax is off by ~1e-6
        teacher_buckets = torch.cat([teacher_lp_BTK[:, window], teacher_tail_BT[:, window, None]], dim=-1).to(rest_BWV.dtype)
        log_ratio = torch.where(student_buckets > -math.inf, student_buckets - teacher_buckets, 0.0)
        values_BW = _kl_consuming(student_buckets, teacher_buckets)[0]
        if not need_grad:
            return values_BW, None
        # dJ/dlogits_v = s_v (log S_b - log T_b - J) for v in bucket b: the tail's slope on
        # the ids outside the top-k, each top-k id's own slope on it.
        slope = log_ratio.sub_(values_BW[..., None])
        return values_BW, rest_BWV.mul_(slope[..., K:]).scatter_(-1, ids_BWK, top_BWK.exp() * slope[..., :K])

    return chunked_on_real_positions(student_hidden_BTH, student_weight_VH, mask_BT, chunk_divergence, chunk_size)
