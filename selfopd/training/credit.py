"""Cures for the privileged illusion: how the verifier's reward and the teacher's signal are
combined into per-token credit. Each is a pure function of tensors, pinned against float64
references in tests/test_credit.py, and each is one setting of `[loss]`:

- teacher-weighted GRPO (RLSD, arXiv 2604.03128), `loss.rlsd_weight`: the verifier decides
  the sign of a rollout's update, the teacher only redistributes its size over the tokens;
- routing (SRPO, arXiv 2604.02288), `loss.opd_on = "failed"`: the teacher term only on
  rollouts the verifier failed;
- a contrastive teacher signal (RLCSD arXiv 2606.11709, CEPO arXiv 2605.19436),
  `loss.opd_baseline = "wrong_context"`: teacher_lp under the true context minus teacher_lp
  under a wrong one, so what any context of that shape shifts cancels;
- pass-rate weighting (SC-SDPO, arXiv 2605.27765), `loss.pass_rate_weighting`: each
  prompt's teacher term weighted by sqrt(p (1 - p)) of its group's pass rate.

They compose: A_t = lambda_rl * A_grpo * rlsd_t + lambda_opd * w_b * clip(s_t), with
s_t = teacher_lp_t - baseline_lp_t (baseline: the student, or the wrong-context teacher),
rlsd_t the RLSD factor of s_t, and w_b the routing and pass-rate weight of rollout b.
Shape letters as in `selfopd.training.objectives`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from selfopd.training.objectives import group_means, grpo_advantage, opd_advantage


def rlsd_lambda(step: int, start: float, decay_steps: int) -> float:
    """RLSD's mixing weight at optimizer step `step` (0-based): `start`, falling linearly to 0
    at `decay_steps` (the paper: 0.5 over 50 steps) and 0 after; decay_steps = 0 keeps it."""
    if decay_steps <= 0:
        return start
    return start * max(0.0, 1.0 - step / decay_steps)


def rlsd_factor(grpo_BT: Tensor, signal_BT: Tensor, lam: float, clip: float) -> Tensor:
    """(1 - l) + l * clip(exp(sign(A) * s_t), 1 - e, 1 + e) per token, detached.

    A rollout the verifier rewards (A > 0) is reinforced more on tokens the teacher likes
    more than the baseline (s_t > 0) and less elsewhere; a penalised one (A < 0) is pushed
    down hardest where the teacher likes it least. The factor never changes the sign of A,
    and it is at most 1 + e, so a copied answer is only ever reinforced when it was right.
    """
    sign_BT = torch.sign(grpo_BT.detach())
    weight_BT = torch.exp(sign_BT * signal_BT.detach()).clamp(1.0 - clip, 1.0 + clip)
    return (1.0 - lam) + lam * weight_BT


def pass_rate_weights(correct_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """sqrt(p (1 - p)) per rollout, p its group's share of correct rollouts (float64):
    0 for a group all right or all wrong, at most 0.5 (p = 1/2)."""
    weight_G, group_B = _group_pass_weights(correct_B, group_ids_B)
    return weight_G[group_B]


def _group_pass_weights(correct_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor]:
    p_G, group_B = group_means(correct_B.double(), group_ids_B)
    return (p_G * (1.0 - p_G)).sqrt(), group_B


def opd_rollout_weights(correct_B: Tensor, group_ids_B: Tensor, opd_on: str, pass_rate: bool,
                        pass_rate_mean: float | None = None) -> Tensor:
    """The weight w_b of each rollout's teacher term (float64, (B,)): 1, times 0 for a correct
    rollout when `opd_on` = "failed", times its pass-rate weight over `pass_rate_mean` (the mean
    pass-rate weight over the step's prompts, all ranks: SC-SDPO's batch-adaptive
    normalisation, so the weights average 1 over prompts; 0 when every prompt's group is all
    right or all wrong, and then the teacher term is off for the step)."""
    weight_B = torch.ones(correct_B.shape, dtype=torch.float64)
    if opd_on == "failed":
        weight_B = weight_B * (~correct_B.bool()).double()
    elif opd_on != "all":
        raise ValueError(f"opd_on must be 'all' or 'failed', got {opd_on!r}")
    if pass_rate:
        if pass_rate_mean is None:
            raise ValueError("pass-rate weighting needs the step's mean pass-rate weight")
        raw_B = pass_rate_weights(correct_B, group_ids_B)
        weight_B = weight_B * (raw_B / pass_rate_mean if pass_rate_mean > 0 else torch.zeros_like(raw_B))
    return weight_B


def mean_prompt_weight(correct_B: Tensor, group_ids_B: Tensor) -> tuple[float, int]:
    """(sum over this batch's prompts of sqrt(p (1 - p)), number of prompts): summed over
    ranks, their ratio is `opd_rollout_weights`' `pass_rate_mean`."""
    weight_G, _ = _group_pass_weights(correct_B, group_ids_B)
    return float(weight_G.sum()), weight_G.numel()


def cure_advantage(
    teacher_lp_BT: Tensor,
    baseline_lp_BT: Tensor,
    mask_BT: Tensor,
    rewards_B: Tensor,
    group_ids_B: Tensor,
    opd_weight_B: Tensor,
    lambda_opd: float,
    lambda_rl: float,
    rlsd_lam: float = 0.0,
    rlsd_clip: float = 0.2,
    token_clip: float = 0.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """(the full sampled-token advantage, its GRPO part alone), both (B, T), detached, 0 off
    completions. With rlsd_lam = 0, every w_b = 1 and the student as baseline, this is
    `objectives.combined_advantage` exactly. The GRPO part (with its RLSD factor) is what an
    exact-divergence loss keeps as a policy gradient."""
    mask_BT = mask_BT.bool()
    signal_BT = opd_advantage(teacher_lp_BT, baseline_lp_BT, mask_BT)  # unclipped s_t, 0 off completions
    zeros_BT = torch.zeros_like(signal_BT)
    grpo_BT = zeros_BT
    if lambda_rl != 0.0:
        grpo_B = grpo_advantage(rewards_B, group_ids_B, eps).to(signal_BT.dtype)
        grpo_BT = torch.where(mask_BT, grpo_B[:, None].expand_as(signal_BT), zeros_BT)
        if rlsd_lam != 0.0:
            grpo_BT = grpo_BT * rlsd_factor(grpo_BT, signal_BT, rlsd_lam, rlsd_clip)
        grpo_BT = lambda_rl * grpo_BT
    opd_BT = opd_advantage(teacher_lp_BT, baseline_lp_BT, mask_BT, token_clip) if token_clip > 0 else signal_BT
    weight_BT = opd_weight_B.to(signal_BT.dtype)[:, None]
    return grpo_BT + lambda_opd * (weight_BT * opd_BT), grpo_BT
