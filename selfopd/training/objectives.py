"""The trainer objective: per-token advantages and the reverse-KL policy-gradient loss.

Every function here is a pure function of tensors, so each can be pinned by a test against
a brute-force float64 reference (tests/test_losses.py). The full-distribution divergences
and the chunked machinery behind them live in `selfopd.engines.kernels`; step metrics in
`selfopd.training.loss_metrics`.

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

from typing import Literal

import torch
from torch import Tensor

Normalisation = Literal["token", "sequence"]


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def opd_advantage(teacher_lp_BT: Tensor, student_lp_BT: Tensor, mask_BT: Tensor, token_clip: float = 0.0) -> Tensor:
    """Per-token OPD advantage A_t = teacher_lp_t - student_lp_t, detached, 0 off completions.

    Reverse KL, KL(student || teacher) = E_{y ~ student}[log student(y) - log teacher(y)]:
    p = student (the sampling distribution), q = teacher. A_t is MINUS the per-token sampled
    estimate of it, so maximising A (gradient ascent on A * log student) lowers the reverse
    KL: tokens the teacher likes more than the student get pushed up.

    `token_clip` c > 0 clips A_t to [-c, c]: one token the teacher finds absurd (an answer
    digit it would have copied, say) then cannot outweigh the rest of the sequence.
    """
    _check_same_shape(teacher_lp_BT=teacher_lp_BT, student_lp_BT=student_lp_BT, mask_BT=mask_BT)
    diff_BT = teacher_lp_BT.detach() - student_lp_BT.detach()
    if token_clip > 0:
        diff_BT = diff_BT.clamp(-token_clip, token_clip)
    return torch.where(mask_BT.bool(), diff_BT, torch.zeros_like(diff_BT))


def clipped_divergence(divergence_BT: Tensor, token_clip: float) -> Tensor:
    """A per-token divergence clamped at `token_clip` (0: unchanged): a clamped position is
    constant, so it gives no gradient, and the others are untouched."""
    if token_clip <= 0:
        return divergence_BT
    return torch.where(divergence_BT > token_clip, divergence_BT.detach().clamp(max=token_clip), divergence_BT)


def clipped_tokens(values_BT: Tensor, mask_BT: Tensor, token_clip: float, two_sided: bool) -> Tensor:
    """(B, T) bool: the completion tokens that `token_clip` clips (none when it is 0):
    |value| > c for the sampled advantage (`two_sided`), value > c for a divergence."""
    if token_clip <= 0:
        return torch.zeros_like(mask_BT, dtype=torch.bool)
    outside_BT = (values_BT.abs() if two_sided else values_BT).detach() > token_clip
    return outside_BT & mask_BT.bool()


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
    mean_G, group_N = group_means(rewards_N, group_ids_N)
    zeros_G = rewards_N.new_zeros(mean_G.numel())
    centred_N = rewards_N - mean_G[group_N]
    std_G = group_means(centred_N**2, group_ids_N)[0].sqrt()
    high_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amax", include_self=False)
    low_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amin", include_self=False)
    flat_N = (high_G == low_G)[group_N]
    advantage_N = centred_N / (std_G[group_N] + eps)
    return torch.where(flat_N, torch.zeros_like(advantage_N), advantage_N)


def group_means(values_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor]:
    """(the mean of `values_N` per group, (G,); each sample's group as a dense index 0..G-1, (N,)).
    Groups are named by any integers, in any order, and may differ in size."""
    _, group_N = torch.unique(group_ids_N, return_inverse=True)
    zeros_G = values_N.new_zeros(int(group_N.max().item()) + 1 if group_N.numel() else 0)
    count_G = zeros_G.index_add(0, group_N, torch.ones_like(values_N))
    return zeros_G.index_add(0, group_N, values_N) / count_G, group_N


def combined_advantage(
    teacher_lp_BT: Tensor,
    student_lp_BT: Tensor,
    mask_BT: Tensor,
    rewards_B: Tensor | None = None,
    group_ids_B: Tensor | None = None,
    lambda_opd: float = 1.0,
    lambda_rl: float = 0.0,
    eps: float = 1e-6,
    token_clip: float = 0.0,
) -> Tensor:
    """GRPO+OPD advantage: A = lambda_rl * A_grpo + lambda_opd * clip(teacher_lp - student_lp).

    The GRPO term is one number per sequence, broadcast to each of its completion tokens;
    the OPD term is per token (see `opd_advantage` for its sign and `token_clip`, which
    clips it before it is weighted). Pure OPD is the default (lambda_rl = 0, rewards not
    needed). Returns (B, T), detached, 0 off completions.
    """
    mask_BT = mask_BT.bool()
    advantage_BT = lambda_opd * opd_advantage(teacher_lp_BT, student_lp_BT, mask_BT, token_clip)
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
