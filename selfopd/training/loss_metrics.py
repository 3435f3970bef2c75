"""What a training step reports about the OPD signal: the sampled reverse KL, advantage
statistics, importance ratios and rewards, from per-token tensors (float64 sums); and whether
the signal favours the student's correct attempts over its wrong ones."""

from __future__ import annotations

import math
from typing import Hashable, Iterable

import torch
from torch import Tensor

from selfopd.core.stats import correct_minus_wrong


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


def preference_metrics(rollouts: Iterable[tuple[Hashable, bool, float]]) -> dict[str, float]:
    """A step's teacher-prefers-correct inputs (see `selfopd.core.stats.correct_minus_wrong`), as
    sums so that `selfopd.training.guard` can pool them over a window of steps:
      opd/correct_preference          mean contrast over the step's groups (absent: no group has both outcomes)
      opd/correct_preference_groups   how many groups had both outcomes
      opd/correct_preference_sum      sum of their contrasts
      opd/correct_preference_sumsq    sum of their squares
    """
    contrasts = list(correct_minus_wrong(rollouts).values())
    return {
        **({"opd/correct_preference": sum(contrasts) / len(contrasts)} if contrasts else {}),
        "opd/correct_preference_groups": float(len(contrasts)),
        "opd/correct_preference_sum": float(sum(contrasts)),
        "opd/correct_preference_sumsq": float(sum(c * c for c in contrasts)),
    }
