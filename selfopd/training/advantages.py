"""Per-token credit: the OPD advantage of each sampled token, the GRPO advantage of each
rollout, and the cures for the privileged illusion that combine the two. Pure functions of
tensors, pinned against float64 references written from each paper's formula in
tests/training/test_advantages.py; `selfopd.training.loss` assembles them into the loss.

The cures, each one setting of `[loss]`:
- teacher-weighted GRPO (RLSD, arXiv 2604.03128), `loss.rlsd_weight`: the verifier decides
  the sign of a rollout's update, the teacher only redistributes its size over the tokens;
- routing (SRPO, arXiv 2604.02288), `loss.opd_on = "failed"`: the teacher term only on
  rollouts the verifier failed;
- a contrastive teacher signal (RLCSD arXiv 2606.11709, CEPO arXiv 2605.19436),
  `loss.opd_baseline = "wrong_context"`: teacher_lp under the true context minus teacher_lp
  under a wrong one, so what any context of that shape shifts cancels;
- pass-rate weighting (SC-SDPO, arXiv 2605.27765), `loss.pass_rate_weighting`: each
  prompt's teacher term weighted by sqrt(p (1 - p)) of its group's pass rate.

They compose: A_t = lambda_rl * A_grpo * rlsd_t + lambda_opd * w_b * clip(s_t), with A_grpo the
rollout's GRPO advantage (`rl_advantage`: group-normalised by default, `loss.rl_advantage`), and
s_t = teacher_lp_t - baseline_lp_t (baseline: the student, the wrong-context teacher, or the
teacher engine's own logprob after the student's prompt), rlsd_t the RLSD factor of s_t, and
w_b the routing and pass-rate weight of rollout b. Shape letters as in `selfopd.training.loss`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_same_shape(**tensors: Tensor) -> None:
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
    check_same_shape(teacher_lp_BT=teacher_lp_BT, student_lp_BT=student_lp_BT, mask_BT=mask_BT)
    diff_BT = teacher_lp_BT.detach() - student_lp_BT.detach()
    if token_clip > 0:
        diff_BT = diff_BT.clamp(-token_clip, token_clip)
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
    centred_N, group_N, flat_N = _centred(rewards_N, group_ids_N)
    std_G = group_means(centred_N**2, group_ids_N)[0].sqrt()
    advantage_N = centred_N / (std_G[group_N] + eps)
    return torch.where(flat_N, torch.zeros_like(advantage_N), advantage_N)


def _centred(rewards_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(r - mean_group, each sample's dense group index, whether its group's rewards are all equal)."""
    if rewards_N.ndim != 1 or rewards_N.shape != group_ids_N.shape:
        raise ValueError(f"need 1-D rewards and group ids of one length, got {tuple(rewards_N.shape)} and {tuple(group_ids_N.shape)}")
    rewards_N = rewards_N.detach()
    if not rewards_N.is_floating_point():
        rewards_N = rewards_N.float()
    mean_G, group_N = group_means(rewards_N, group_ids_N)
    zeros_G = rewards_N.new_zeros(mean_G.numel())
    centred_N = rewards_N - mean_G[group_N]
    high_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amax", include_self=False)
    low_G = zeros_G.scatter_reduce(0, group_N, rewards_N, reduce="amin", include_self=False)
    return centred_N, group_N, (high_G == low_G)[group_N]


def rl_rewards(rewards_N: Tensor, wrong_reward: float = 0.0) -> Tensor:
    """The GRPO term's reward of each rollout: the verifier's (1 correct, 0 wrong, a partial credit
    in between), with a wrong rollout's 0 paid as `wrong_reward` (`loss.wrong_reward`; -1: the
    +1 / -1 rewards of the Modal OPD tutorial). Detached, floating point."""
    rewards_N = rewards_N.detach()
    if not rewards_N.is_floating_point():
        rewards_N = rewards_N.float()
    if wrong_reward == 0.0:
        return rewards_N
    return torch.where(rewards_N == 0, torch.full_like(rewards_N, wrong_reward), rewards_N)


def rl_advantage(rewards_N: Tensor, group_ids_N: Tensor, kind: str = "group_norm", wrong_reward: float = 0.0,
                 eps: float = 1e-6) -> Tensor:
    """The GRPO term's advantage of each rollout (`loss.rl_advantage`), from `rl_rewards`:
      "group_norm"  (r - mean) / (std + eps) over the group (`grpo_advantage`, the default);
      "group_mean"  r - mean, no std (exactly 0 for a group whose rewards are all equal);
      "raw"         r itself, no baseline: a group all wrong gets wrong_reward on every rollout
                    (slime with a custom reward post-process, as the Modal OPD tutorial runs it).
    With wrong_reward = 0, "group_norm" is `grpo_advantage` of the verifier's rewards bit for bit."""
    rewards_N = rl_rewards(rewards_N, wrong_reward)
    if kind == "group_norm":
        return grpo_advantage(rewards_N, group_ids_N, eps)
    centred_N, _, flat_N = _centred(rewards_N, group_ids_N)  # checks the shapes for "raw" too
    if kind == "group_mean":
        return torch.where(flat_N, torch.zeros_like(centred_N), centred_N)
    if kind == "raw":
        return rewards_N
    raise ValueError(f"rl_advantage must be 'group_norm', 'group_mean' or 'raw', got {kind!r}")


def group_means(values_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor]:
    """(the mean of `values_N` per group, (G,); each sample's group as a dense index 0..G-1, (N,)).
    Groups are named by any integers, in any order, and may differ in size."""
    _, group_N = torch.unique(group_ids_N, return_inverse=True)
    zeros_G = values_N.new_zeros(int(group_N.max().item()) + 1 if group_N.numel() else 0)
    count_G = zeros_G.index_add(0, group_N, torch.ones_like(values_N))
    return zeros_G.index_add(0, group_N, values_N) / count_G, group_N


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
    rl_kind: str = "group_norm",
    wrong_reward: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(the full sampled-token advantage, its GRPO part alone), both (B, T), detached, 0 off
    completions. With rlsd_lam = 0, every w_b = 1 and the student as baseline, this is
    lambda_rl * A_grpo + lambda_opd * clip(teacher_lp - student_lp). The GRPO part (with its RLSD factor) is what an
    exact-divergence loss keeps as a policy gradient; A_grpo is `rl_advantage` of kind `rl_kind`."""
    mask_BT = mask_BT.bool()
    signal_BT = opd_advantage(teacher_lp_BT, baseline_lp_BT, mask_BT)  # unclipped s_t, 0 off completions
    zeros_BT = torch.zeros_like(signal_BT)
    grpo_BT = zeros_BT
    if lambda_rl != 0.0:
        grpo_B = rl_advantage(rewards_B, group_ids_B, rl_kind, wrong_reward, eps).to(signal_BT.dtype)
        grpo_BT = torch.where(mask_BT, grpo_B[:, None].expand_as(signal_BT), zeros_BT)
        if rlsd_lam != 0.0:
            grpo_BT = grpo_BT * rlsd_factor(grpo_BT, signal_BT, rlsd_lam, rlsd_clip)
        grpo_BT = lambda_rl * grpo_BT
    opd_BT = opd_advantage(teacher_lp_BT, baseline_lp_BT, mask_BT, token_clip) if token_clip > 0 else signal_BT
    weight_BT = opd_weight_B.to(signal_BT.dtype)[:, None]
    return grpo_BT + lambda_opd * (weight_BT * opd_BT), grpo_BT
