"""The trainer objective: per-token advantages, the reverse-KL policy-gradient loss, metrics.

Every function here is a pure function of tensors, so each can be pinned by a test against
a brute-force float64 reference (tests/test_losses.py, tests/test_loss_variants.py).

Shape convention: a tensor's name ends in its shape letters.
    B  sequences (rollouts) in the batch      T  token positions      V  vocabulary
    H  hidden size                             N  samples (B when per sequence)
    K  teacher top-k entries per position      C  positions in one chunk
`mask_BT` is 1 (True) on completion tokens, the only tokens that are trained; prompt and
padding positions are 0. A masked position contributes exactly zero to every loss and
metric and gets exactly zero gradient, whatever garbage (inf, nan) its inputs hold.
Logprob tensors are aligned with the tokens they score: `x_lp_BT[b, t]` is
log p(tokens[b, t] | tokens[b, :t]); the caller does the usual one-position shift.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import Tensor

Normalisation = Literal["token", "sequence"]


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def opd_advantage(teacher_lp_BT: Tensor, student_lp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-token OPD advantage A_t = teacher_lp_t - student_lp_t, detached, 0 off completions.

    Reverse KL, KL(student || teacher) = E_{y ~ student}[log student(y) - log teacher(y)]:
    p = student (the sampling distribution), q = teacher. A_t is MINUS the per-token sampled
    estimate of it, so maximising A (gradient ascent on A * log student) lowers the reverse
    KL: tokens the teacher likes more than the student get pushed up.
    """
    _check_same_shape(teacher_lp_BT=teacher_lp_BT, student_lp_BT=student_lp_BT, mask_BT=mask_BT)
    diff_BT = teacher_lp_BT.detach() - student_lp_BT.detach()
    return torch.where(mask_BT.bool(), diff_BT, torch.zeros_like(diff_BT))


def grpo_advantage(rewards_N: Tensor, group_ids_N: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO advantage per sample: (r - mean_group) / (std_group + eps).

    Groups are the n samples of one prompt, named by `group_ids_N` (any integers, in any
    order, groups may differ in size). For the (num_prompts, n) layout pass
    `torch.arange(num_prompts).repeat_interleave(n)` with the rewards flattened row-major.
    std is the population std (divide by the group size, not size - 1): the normalised
    group then has std ~1, a group of one is defined (advantage 0), and {0, 1} rewards
    give +-1. A group whose rewards are all equal carries no signal and gets exactly 0
    (never nan, and no rounding residue from the mean).
    """
    if rewards_N.ndim != 1 or rewards_N.shape != group_ids_N.shape:
        raise ValueError(f"need 1-D rewards and group ids of one length, got {tuple(rewards_N.shape)} and {tuple(group_ids_N.shape)}")
    rewards_N = rewards_N.detach()
    if not rewards_N.is_floating_point():
        rewards_N = rewards_N.float()
    _, group_N = torch.unique(group_ids_N, return_inverse=True)  # dense 0..G-1
    num_groups = int(group_N.max().item()) + 1 if group_N.numel() else 0
    zeros_G = rewards_N.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, group_N, torch.ones_like(rewards_N))
    mean_G = zeros_G.index_add(0, group_N, rewards_N) / count_G
    centred_N = rewards_N - mean_G[group_N]
    std_G = (zeros_G.index_add(0, group_N, centred_N**2) / count_G).sqrt()
    high_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amax", include_self=False)
    low_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amin", include_self=False)
    flat_N = (high_G == low_G)[group_N]
    advantage_N = centred_N / (std_G[group_N] + eps)
    return torch.where(flat_N, torch.zeros_like(advantage_N), advantage_N)


def combined_advantage(
    teacher_lp_BT: Tensor,
    student_lp_BT: Tensor,
    mask_BT: Tensor,
    rewards_B: Tensor | None = None,
    group_ids_B: Tensor | None = None,
    lambda_opd: float = 1.0,
    lambda_rl: float = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO+OPD advantage: A = lambda_rl * A_grpo + lambda_opd * (teacher_lp - student_lp).

    The GRPO term is one number per sequence, broadcast to each of its completion tokens;
    the OPD term is per token (see `opd_advantage` for its sign). Pure OPD is the default
    (lambda_rl = 0, rewards not needed). Returns (B, T), detached, 0 off completions.
    """
    mask_BT = mask_BT.bool()
    advantage_BT = lambda_opd * opd_advantage(teacher_lp_BT, student_lp_BT, mask_BT)
    if lambda_rl != 0.0:
        if rewards_B is None or group_ids_B is None:
            raise ValueError("lambda_rl != 0 needs rewards_B and group_ids_B")
        if rewards_B.shape != mask_BT.shape[:1]:
            raise ValueError(f"rewards_B has shape {tuple(rewards_B.shape)}, need ({mask_BT.shape[0]},)")
        grpo_B = grpo_advantage(rewards_B, group_ids_B, eps).to(advantage_BT.dtype)
        grpo_BT = torch.where(mask_BT, grpo_B[:, None], torch.zeros_like(advantage_BT))
        advantage_BT = lambda_rl * grpo_BT + advantage_BT
    return advantage_BT


def truncated_is_ratio(trainer_lp_BT: Tensor, sampler_lp_BT: Tensor, cap: float | None) -> Tensor:
    """Truncated importance weight min(pi_trainer / pi_sampler, cap) per token, detached.

    The sampler (vLLM, or stale weights) is not exactly the trainer's policy; reweighting by
    pi/mu makes the sampled-token gradient unbiased for the trainer's policy, and the cap
    bounds its variance (truncated IS). cap=None disables truncation. Detached: it is a
    weight on the gradient, not something to differentiate (unlike PPO's ratio).
    """
    _check_same_shape(trainer_lp_BT=trainer_lp_BT, sampler_lp_BT=sampler_lp_BT)
    ratio_BT = torch.exp(trainer_lp_BT.detach() - sampler_lp_BT.detach())
    return ratio_BT if cap is None else ratio_BT.clamp(max=cap)


def policy_gradient_loss(
    logpi_BT: Tensor,
    advantage_BT: Tensor,
    mask_BT: Tensor,
    ratio_BT: Tensor | None = None,
    normalisation: Normalisation = "token",
) -> Tensor:
    """loss = -mean(ratio * A * logpi) over completion tokens; scalar, differentiable in logpi.

    `logpi_BT` are the trainer's current logprobs of the sampled tokens (with grad); A and
    ratio are treated as constants. With A = teacher_lp - student_lp (and ratio 1 on
    policy), the expected gradient is the gradient of reverse KL(student || teacher):
    minimising this loss moves the student toward the teacher in the mode-seeking direction.
    normalisation:
      "token"    sum over all completion tokens in the batch / their number (every token
                 weighs the same; long sequences weigh more);
      "sequence" mean over each sequence's completion tokens, then mean over the sequences
                 that have at least one (every sequence weighs the same).
    """
    _check_same_shape(logpi_BT=logpi_BT, advantage_BT=advantage_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logpi_BT)
    # Mask each factor, not only the product: inf * 0 in an unselected branch would still
    # put nan into the gradient.
    weight_BT = torch.where(mask_BT, advantage_BT.detach().to(logpi_BT.dtype), zeros_BT)
    if ratio_BT is not None:
        _check_same_shape(logpi_BT=logpi_BT, ratio_BT=ratio_BT)
        weight_BT = weight_BT * torch.where(mask_BT, ratio_BT.detach().to(logpi_BT.dtype), zeros_BT)
    term_BT = weight_BT * torch.where(mask_BT, logpi_BT, zeros_BT)
    return -masked_mean(term_BT, mask_BT, normalisation)


def masked_mean(values_BT: Tensor, mask_BT: Tensor, normalisation: Normalisation = "token") -> Tensor:
    """Mean of per-token values over completion tokens; scalar, 0 when there are none.

    The one reduction every loss here shares, so they all weigh tokens alike (see
    `policy_gradient_loss` for "token" vs "sequence"). Masked values are dropped, not
    multiplied by 0, so inf or nan there cannot leak into the result or its gradient.
    """
    _check_same_shape(values_BT=values_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.bool()
    values_BT = torch.where(mask_BT, values_BT, torch.zeros_like(values_BT))
    count_B = mask_BT.sum(dim=1).to(values_BT.dtype)
    if normalisation == "token":
        return values_BT.sum() / count_B.sum().clamp(min=1)
    if normalisation == "sequence":
        per_sequence_B = values_BT.sum(dim=1) / count_B.clamp(min=1)
        return per_sequence_B.sum() / (count_B > 0).sum().clamp(min=1)
    raise ValueError(f"normalisation must be 'token' or 'sequence', got {normalisation!r}")


# ---- logprobs of given tokens, chunked ---------------------------------------------------


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits).gather(tokens) without ever holding a (B, T, V) fp32 tensor.

    Forward keeps only the per-position log-normaliser (B, T); backward recomputes the
    softmax chunk by chunk and writes d/dlogits = g * (onehot - softmax) into one gradient
    tensor (which, like the logits, is (B, T, V) in the logits' dtype).
    """

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, tokens_BT: Tensor, chunk_size: int) -> Tensor:
        dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
        B, T, _ = logits_BTV.shape
        logprobs_BT = torch.empty(B, T, dtype=dtype, device=logits_BTV.device)
        lse_BT = torch.empty_like(logprobs_BT)
        for start in range(0, T, chunk_size):
            chunk_BCV = logits_BTV[:, start : start + chunk_size].to(dtype)
            tokens_BC1 = tokens_BT[:, start : start + chunk_size, None]
            lse_BC = torch.logsumexp(chunk_BCV, dim=-1)
            lse_BT[:, start : start + chunk_size] = lse_BC
            logprobs_BT[:, start : start + chunk_size] = chunk_BCV.gather(-1, tokens_BC1).squeeze(-1) - lse_BC
        ctx.save_for_backward(logits_BTV, tokens_BT, lse_BT)
        ctx.chunk_size = chunk_size
        return logprobs_BT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BT: Tensor):
        logits_BTV, tokens_BT, lse_BT = ctx.saved_tensors
        grad_logits_BTV = torch.empty_like(logits_BTV)
        for start in range(0, logits_BTV.shape[1], ctx.chunk_size):
            window = slice(start, start + ctx.chunk_size)
            grad_BC1 = grad_BT[:, window, None]
            softmax_BCV = torch.exp(logits_BTV[:, window].to(lse_BT.dtype) - lse_BT[:, window, None])
            chunk_BCV = -grad_BC1 * softmax_BCV
            chunk_BCV.scatter_add_(-1, tokens_BT[:, window, None], grad_BC1)
            grad_logits_BTV[:, window] = chunk_BCV
        return grad_logits_BTV, None, None


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor, chunk_size: int = 256) -> Tensor:
    """log softmax(logits)[token] per position, computed `chunk_size` positions at a time.

    A full fp32 log-softmax of a long sequence over a large vocabulary is what runs out of
    memory first (DESIGN.md section 3); this never holds more than (B, chunk_size, V) of it,
    in forward or backward. Computed in at least fp32 (fp64 stays fp64). Differentiable once
    in the logits. `logits_BTV[:, t]` must already be the distribution over `tokens_BT[:, t]`.
    """
    if logits_BTV.ndim != 3 or tokens_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(f"need logits (B, T, V) and tokens (B, T), got {tuple(logits_BTV.shape)} and {tuple(tokens_BT.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedTokenLogprobs.apply(logits_BTV, tokens_BT.long(), chunk_size)


def token_logprobs_from_hidden(
    hidden_BTH: Tensor, lm_head_weight_VH: Tensor, tokens_BT: Tensor, chunk_size: int = 256
) -> Tensor:
    """Like `token_logprobs`, from final hidden states and the unembedding matrix.

    Skips the (B, T, V) logits tensor altogether: each chunk's logits are formed, scored and
    dropped, and recomputed in backward, where the analytic gradient onehot - softmax goes
    straight to hidden and weight (the chunked machinery of the divergences below: about
    three (B, chunk, V) tensors at a time, where per-chunk checkpointing kept about five).
    Only for a plain linear head (no bias, logit scaling or soft-capping), as in
    Llama/Qwen/SmolLM2; `hidden_BTH` is the output of the final norm.
    """
    if hidden_BTH.ndim != 3 or tokens_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(f"need hidden (B, T, H) and tokens (B, T), got {tuple(hidden_BTH.shape)} and {tuple(tokens_BT.shape)}")
    tokens_BT = tokens_BT.long()

    def chunk_token_logprob(student_lp_BCV: Tensor, window: slice, mask_BC: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        tokens_BC1 = tokens_BT[:, window, None]
        values_BC = student_lp_BCV.gather(-1, tokens_BC1).squeeze(-1)
        if not need_grad:
            return values_BC, None
        grad_BCV = student_lp_BCV.exp_().neg_()  # d log s_y / d logits = onehot(y) - s
        return values_BC, grad_BCV.scatter_add_(-1, tokens_BC1, torch.ones_like(tokens_BC1, dtype=grad_BCV.dtype))

    everywhere_BT = torch.ones(tokens_BT.shape, dtype=torch.bool, device=tokens_BT.device)
    _check_student(hidden_BTH, lm_head_weight_VH, everywhere_BT, chunk_size)
    return _ChunkedDivergence.apply(hidden_BTH, lm_head_weight_VH, everywhere_BT, chunk_token_logprob, chunk_size)


# ---- full-distribution divergences, chunked -----------------------------------------------
#
# Sampled-token OPD (above) sees one token per position. These losses compare whole
# next-token distributions: the student's (from its final hidden states and unembedding
# matrix) with a teacher's, given in full (logits, or hidden states and unembedding of an
# in-process teacher) or as its top-k (what an engine such as vLLM returns). Each returns
# per-token values (B, T), 0 on masked positions; reduce them with `masked_mean`. Only the
# student gets a gradient; the teacher is always detached.

Divergence = Literal["reverse_kl", "forward_kl", "jsd"]

# One chunk of a divergence: (student logprobs (B, C, V), which it may overwrite; window of
# positions; mask (B, C); whether the gradient is wanted) -> (values (B, C), dJ/dlogits
# (B, C, V) or None). The chunk owns its (B, C, V) buffers, so it can work in place.
ChunkDivergence = Callable[[Tensor, slice, Tensor, bool], tuple[Tensor, Tensor | None]]


def _kl_consuming(p_lp_BCV: Tensor, q_lp_BCV: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(KL(p || q) (B, C), p, the terms p (log p - log q)), the terms written over p_lp.

    A term is exactly 0 where p = 0, even where q = 0 too (0 * inf, -inf + inf); q = 0
    where p > 0 gives inf, as it should.
    """
    p_BCV = p_lp_BCV.exp()
    terms_BCV = p_lp_BCV.sub_(q_lp_BCV).mul_(p_BCV).masked_fill_(p_BCV == 0, 0.0)
    return terms_BCV.sum(-1), p_BCV, terms_BCV


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate both for x near 0 and for x very negative."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _logprobs_from_hidden(hidden_BCH: Tensor, weight_VH: Tensor, mask_BC: Tensor, dtype: torch.dtype) -> Tensor:
    """log_softmax(hidden @ weight.T) in `dtype`; masked positions read zeros (a uniform
    distribution), so inf or nan hidden states there never reach a value or gradient."""
    hidden_BCH = torch.where(mask_BC[..., None], hidden_BCH, 0.0)
    return torch.log_softmax((hidden_BCH @ weight_VH.T).to(dtype), dim=-1)


class _ChunkedDivergence(torch.autograd.Function):
    """values_BT = J(softmax(hidden @ weight.T), teacher) per position, chunk by chunk.

    Nothing of size V outlives a chunk: forward keeps only its inputs, and backward
    recomputes each chunk and applies its analytic dJ/dlogits straight to hidden and
    weight. Autograd through the same arithmetic would keep several (B, T, V) tensors
    (checkpointing per chunk still keeps several (B, chunk, V) ones while recomputing);
    this way a chunk peaks at about three (B, chunk, V) tensors (four for JSD).
    """

    @staticmethod
    def forward(ctx, hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_divergence: ChunkDivergence, chunk_size: int) -> Tensor:
        dtype = torch.promote_types(torch.promote_types(hidden_BTH.dtype, weight_VH.dtype), torch.float32)
        values_BT = torch.zeros(mask_BT.shape, dtype=dtype, device=hidden_BTH.device)
        for start in range(0, hidden_BTH.shape[1], chunk_size):
            window = slice(start, start + chunk_size)
            mask_BC = mask_BT[:, window]
            # Passed without a name, so the chunk can free the student's logprobs early.
            chunk_BC, _ = chunk_divergence(_logprobs_from_hidden(hidden_BTH[:, window], weight_VH, mask_BC, dtype), window, mask_BC, False)
            values_BT[:, window] = torch.where(mask_BC, chunk_BC, 0.0)
        ctx.save_for_backward(hidden_BTH, weight_VH, mask_BT)
        ctx.chunk_divergence, ctx.chunk_size, ctx.dtype = chunk_divergence, chunk_size, dtype
        return values_BT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BT: Tensor):
        hidden_BTH, weight_VH, mask_BT = ctx.saved_tensors
        grad_hidden_BTH = torch.zeros_like(hidden_BTH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=ctx.dtype, device=weight_VH.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden_BTH.shape[1], ctx.chunk_size):
            window = slice(start, start + ctx.chunk_size)
            mask_BC = mask_BT[:, window]
            _, grad_logits_BCV = ctx.chunk_divergence(_logprobs_from_hidden(hidden_BTH[:, window], weight_VH, mask_BC, ctx.dtype), window, mask_BC, True)
            grad_logits_BCV.mul_(torch.where(mask_BC, grad_BT[:, window].to(ctx.dtype), 0.0)[..., None])
            if grad_hidden_BTH is not None:
                grad_hidden_BTH[:, window] = grad_logits_BCV.to(weight_VH.dtype) @ weight_VH
            if grad_weight_VH is not None:
                hidden_NH = torch.where(mask_BC[..., None], hidden_BTH[:, window], 0.0).flatten(0, 1)
                grad_weight_VH += grad_logits_BCV.flatten(0, 1).T.to(hidden_NH.dtype) @ hidden_NH
            del grad_logits_BCV
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_BTH, grad_weight_VH, None, None, None


def _check_student(hidden_BTH: Tensor, weight_VH: Tensor, mask_BT: Tensor, chunk_size: int) -> None:
    if hidden_BTH.ndim != 3 or weight_VH.ndim != 2 or hidden_BTH.shape[-1] != weight_VH.shape[-1] or mask_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(
            f"need student hidden (B, T, H), weight (V, H) and mask (B, T), got "
            f"{tuple(hidden_BTH.shape)}, {tuple(weight_VH.shape)} and {tuple(mask_BT.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def full_vocab_divergence(
    student_hidden_BTH: Tensor,
    student_weight_VH: Tensor,
    mask_BT: Tensor,
    *,
    teacher_logits_BTV: Tensor | None = None,
    teacher_hidden_BTH: Tensor | None = None,
    teacher_weight_VH: Tensor | None = None,
    divergence: Divergence = "reverse_kl",
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
                    `generalized_jsd_loss`: with m = beta t + (1 - beta) s,
                    beta KL(t || m) + (1 - beta) KL(s || m). It tends to 0 at both ends, so,
                    as in TRL, beta = 0 is defined as forward KL and beta = 1 as reverse KL
                    (the limits of JSD / beta and JSD / (1 - beta)).
    Computed in at least fp32 (fp64 stays fp64), with the head's matmul in the inputs' dtype
    as in `token_logprobs_from_hidden`. A teacher logprob of -inf where the student has mass
    makes the reverse KL inf, as it should.
    """
    _check_student(student_hidden_BTH, student_weight_VH, mask_BT, chunk_size)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    if divergence not in ("reverse_kl", "forward_kl", "jsd"):
        raise ValueError(f"divergence must be 'reverse_kl', 'forward_kl' or 'jsd', got {divergence!r}")
    B, T, _ = student_hidden_BTH.shape
    V = student_weight_VH.shape[0]
    if teacher_logits_BTV is not None and teacher_hidden_BTH is None and teacher_weight_VH is None:
        if teacher_logits_BTV.shape != (B, T, V):
            raise ValueError(f"teacher logits have shape {tuple(teacher_logits_BTV.shape)}, need {(B, T, V)}")
        teacher_logits_BTV = teacher_logits_BTV.detach()

        def teacher_logprobs(window: slice, mask_BC: Tensor, dtype: torch.dtype) -> Tensor:
            return torch.log_softmax(torch.where(mask_BC[..., None], teacher_logits_BTV[:, window], 0.0).to(dtype), dim=-1)

    elif teacher_logits_BTV is None and teacher_hidden_BTH is not None and teacher_weight_VH is not None:
        if teacher_hidden_BTH.shape[:2] != (B, T) or teacher_weight_VH.shape[0] != V or teacher_hidden_BTH.shape[-1] != teacher_weight_VH.shape[-1]:
            raise ValueError(f"teacher hidden {tuple(teacher_hidden_BTH.shape)} and weight {tuple(teacher_weight_VH.shape)} do not fit {(B, T)} and V = {V}")
        teacher_hidden_BTH, teacher_weight_VH = teacher_hidden_BTH.detach(), teacher_weight_VH.detach()

        def teacher_logprobs(window: slice, mask_BC: Tensor, dtype: torch.dtype) -> Tensor:
            return _logprobs_from_hidden(teacher_hidden_BTH[:, window], teacher_weight_VH, mask_BC, dtype)

    else:
        raise ValueError("give the teacher either as teacher_logits_BTV or as teacher_hidden_BTH and teacher_weight_VH")

    def chunk_divergence(student_lp_BCV: Tensor, window: slice, mask_BC: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        teacher_lp_BCV = teacher_logprobs(window, mask_BC, student_lp_BCV.dtype)
        if divergence == "reverse_kl":
            # dJ/dlogits_v = s_v (log s_v - log t_v - J) = term_v - s_v J
            values_BC, student_BCV, terms_BCV = _kl_consuming(student_lp_BCV, teacher_lp_BCV)
            del student_lp_BCV, teacher_lp_BCV
            return values_BC, (terms_BCV.sub_(student_BCV.mul_(values_BC[..., None])) if need_grad else None)
        if divergence == "forward_kl":
            # dJ/dlogits_v = s_v - t_v
            values_BC, teacher_BCV = _kl_consuming(teacher_lp_BCV, student_lp_BCV)[:2]
            del teacher_lp_BCV
            return values_BC, (student_lp_BCV.exp_().sub_(teacher_BCV) if need_grad else None)
        # jsd: log m = logaddexp(log s + log(1 - beta), log t + log beta), without a temporary
        log_m_BCV = student_lp_BCV + math.log1p(-beta)
        torch.logaddexp(log_m_BCV, teacher_lp_BCV.add_(math.log(beta)), out=log_m_BCV)
        teacher_part_BC = _kl_consuming(teacher_lp_BCV.sub_(math.log(beta)), log_m_BCV)[0]
        del teacher_lp_BCV
        student_part_BC, student_BCV, terms_BCV = _kl_consuming(student_lp_BCV, log_m_BCV)
        del student_lp_BCV, log_m_BCV
        values_BC = beta * teacher_part_BC + (1 - beta) * student_part_BC
        # dJ/ds_v = (1 - beta)(log s_v - log m_v), so
        # dJ/dlogits_v = (1 - beta) s_v (log s_v - log m_v - KL(s || m)) = (1 - beta)(term_v - s_v KL(s || m))
        return values_BC, (terms_BCV.sub_(student_BCV.mul_(student_part_BC[..., None])).mul_(1 - beta) if need_grad else None)

    return _ChunkedDivergence.apply(student_hidden_BTH, student_weight_VH, mask_BT.bool(), chunk_divergence, chunk_size)


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
    _check_student(student_hidden_BTH, student_weight_VH, mask_BT, chunk_size)
    K, V = topk_ids_BTK.shape[-1], student_weight_VH.shape[0]
    if topk_ids_BTK.shape != (*mask_BT.shape, K) or topk_logprobs_BTK.shape != topk_ids_BTK.shape or not 1 <= K <= V:
        raise ValueError(
            f"need top-k ids and logprobs (B, T, K) with 1 <= K <= V = {V}, got {tuple(topk_ids_BTK.shape)} and {tuple(topk_logprobs_BTK.shape)}"
        )
    mask_BT = mask_BT.bool()
    # Masked positions get a harmless stand-in: ids 0..K-1, each with probability 1 / (K + 1).
    ids_BTK = torch.where(mask_BT[..., None], topk_ids_BTK.long(), torch.arange(K, device=topk_ids_BTK.device))
    teacher_lp_BTK = torch.where(mask_BT[..., None], topk_logprobs_BTK.detach(), -math.log(K + 1))
    teacher_tail_BT = topk_tail_logprob(teacher_lp_BTK, tail_floor)

    def chunk_divergence(student_lp_BCV: Tensor, window: slice, mask_BC: Tensor, need_grad: bool) -> tuple[Tensor, Tensor | None]:
        ids_BCK = ids_BTK[:, window]
        top_BCK = student_lp_BCV.gather(-1, ids_BCK)
        rest_BCV = student_lp_BCV.exp_().scatter_(-1, ids_BCK, 0.0)  # student probabilities outside the top-k
        del student_lp_BCV
        student_buckets = torch.cat([top_BCK, rest_BCV.sum(-1, keepdim=True).log()], dim=-1)  # tail -inf when K = V
        student_buckets -= student_buckets.logsumexp(-1, keepdim=True)  # sum exactly 1: fp32 log_softmax is off by ~1e-6
        teacher_buckets = torch.cat([teacher_lp_BTK[:, window], teacher_tail_BT[:, window, None]], dim=-1).to(rest_BCV.dtype)
        log_ratio = torch.where(student_buckets > -math.inf, student_buckets - teacher_buckets, 0.0)
        values_BC = _kl_consuming(student_buckets, teacher_buckets)[0]
        if not need_grad:
            return values_BC, None
        # dJ/dlogits_v = s_v (log S_b - log T_b - J) for v in bucket b: the tail's slope on
        # the ids outside the top-k, each top-k id's own slope on it.
        slope = log_ratio.sub_(values_BC[..., None])
        return values_BC, rest_BCV.mul_(slope[..., K:]).scatter_(-1, ids_BCK, top_BCK.exp() * slope[..., :K])

    return _ChunkedDivergence.apply(student_hidden_BTH, student_weight_VH, mask_BT, chunk_divergence, chunk_size)


# ---- metrics ------------------------------------------------------------------------------


def opd_metrics(
    teacher_lp_BT: Tensor,
    student_lp_BT: Tensor,
    mask_BT: Tensor,
    sampler_lp_BT: Tensor | None = None,
    cap: float | None = None,
    advantage_BT: Tensor | None = None,
    rewards_B: Tensor | None = None,
) -> dict[str, float]:
    """What to watch in an OPD step, as one flat dict of python floats with slash names.

    All means and shares are over completion tokens (nan when there are none); stds are
    population stds. `student_lp_BT` doubles as the trainer's logprobs for the IS metrics.
      tokens/completion              number of completion tokens
      opd/reverse_kl                 mean (student_lp - teacher_lp): sampled reverse KL(student || teacher)
      opd/teacher_logprob_mean       mean teacher_lp
      opd/student_logprob_mean       mean student_lp
      opd/advantage_mean, _std       of teacher_lp - student_lp (= -opd/reverse_kl for the mean)
      opd/positive_advantage_share   share of tokens the teacher likes more than the student
    with sampler_lp_BT:
      is/ratio_mean                  mean truncated ratio min(exp(student_lp - sampler_lp), cap)
      is/ratio_max                   max untruncated ratio
      is/clipped_share               share of tokens whose untruncated ratio exceeds cap (0 if cap is None)
      is/sampler_logprob_abs_diff    mean |student_lp - sampler_lp| (trainer/sampler mismatch)
    with advantage_BT (the advantage the loss used, e.g. GRPO+OPD):
      loss/advantage_mean, loss/advantage_std
    with rewards_B:
      reward/mean                    mean reward over sequences
    """
    mask_BT = mask_BT.bool()
    count = int(mask_BT.sum().item())

    def on_mask(x_BT: Tensor) -> Tensor:  # (count,) float64, completion tokens only
        return x_BT.detach()[mask_BT].double()

    def mean(x: Tensor) -> float:
        return x.mean().item() if x.numel() else math.nan

    def std(x: Tensor) -> float:
        return x.std(correction=0).item() if x.numel() else math.nan

    teacher, student = on_mask(teacher_lp_BT), on_mask(student_lp_BT)
    advantage = teacher - student
    metrics = {
        "tokens/completion": float(count),
        "opd/reverse_kl": mean(student - teacher),
        "opd/teacher_logprob_mean": mean(teacher),
        "opd/student_logprob_mean": mean(student),
        "opd/advantage_mean": mean(advantage),
        "opd/advantage_std": std(advantage),
        "opd/positive_advantage_share": mean((advantage > 0).double()),
    }
    if sampler_lp_BT is not None:
        sampler = on_mask(sampler_lp_BT)
        raw_ratio = torch.exp(student - sampler)
        truncated = raw_ratio if cap is None else raw_ratio.clamp(max=cap)
        metrics["is/ratio_mean"] = mean(truncated)
        metrics["is/ratio_max"] = raw_ratio.max().item() if count else math.nan
        metrics["is/clipped_share"] = mean((raw_ratio > cap).double()) if cap is not None else (0.0 if count else math.nan)
        metrics["is/sampler_logprob_abs_diff"] = mean((student - sampler).abs())
    if advantage_BT is not None:
        combined = on_mask(advantage_BT)
        metrics["loss/advantage_mean"] = mean(combined)
        metrics["loss/advantage_std"] = std(combined)
    if rewards_B is not None:
        metrics["reward/mean"] = mean(rewards_B.detach().double())
    return metrics
