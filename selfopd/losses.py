"""The trainer objective: per-token advantages, the reverse-KL policy-gradient loss, metrics.

Every function here is a pure function of tensors, so each can be pinned by a test against
a brute-force float64 reference (tests/test_losses.py).

Shape convention: a tensor's name ends in its shape letters.
    B  sequences (rollouts) in the batch      T  token positions      V  vocabulary
    H  hidden size                             N  samples (B when per sequence)
`mask_BT` is 1 (True) on completion tokens, the only tokens that are trained; prompt and
padding positions are 0. A masked position contributes exactly zero to every loss and
metric and gets exactly zero gradient, whatever garbage (inf, nan) its inputs hold.
Logprob tensors are aligned with the tokens they score: `x_lp_BT[b, t]` is
log p(tokens[b, t] | tokens[b, :t]); the caller does the usual one-position shift.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.utils.checkpoint
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
    count_B = mask_BT.sum(dim=1).to(logpi_BT.dtype)
    if normalisation == "token":
        return -term_BT.sum() / count_B.sum().clamp(min=1)
    if normalisation == "sequence":
        per_sequence_B = term_BT.sum(dim=1) / count_B.clamp(min=1)
        return -per_sequence_B.sum() / (count_B > 0).sum().clamp(min=1)
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
    dropped, and recomputed in backward (activation checkpointing per chunk). Only for a
    plain linear head (no bias, logit scaling or soft-capping), as in Llama/Qwen/SmolLM2;
    `hidden_BTH` is the output of the final norm (`model.model(...).last_hidden_state`).
    """
    if hidden_BTH.ndim != 3 or tokens_BT.shape != hidden_BTH.shape[:2]:
        raise ValueError(f"need hidden (B, T, H) and tokens (B, T), got {tuple(hidden_BTH.shape)} and {tuple(tokens_BT.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    def score(hidden_BCH: Tensor, tokens_BC: Tensor) -> Tensor:
        logits_BCV = hidden_BCH @ lm_head_weight_VH.T
        return token_logprobs(logits_BCV, tokens_BC, chunk_size=hidden_BCH.shape[1])

    needs_grad = torch.is_grad_enabled() and (hidden_BTH.requires_grad or lm_head_weight_VH.requires_grad)
    chunks = []
    for start in range(0, hidden_BTH.shape[1], chunk_size):
        args = (hidden_BTH[:, start : start + chunk_size], tokens_BT[:, start : start + chunk_size].long())
        if needs_grad:
            chunks.append(torch.utils.checkpoint.checkpoint(score, *args, use_reentrant=False))
        else:
            chunks.append(score(*args))
    return torch.cat(chunks, dim=1)


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
