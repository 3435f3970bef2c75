"""selfopd.training.loss_metrics: what a step reports about the OPD signal, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from selfopd.training.advantages import cure_advantage
from selfopd.training.loss_metrics import opd_metrics

torch.set_num_threads(1)


def test_metrics_by_hand():
    """Completion tokens (mask 1) only: teacher - student = [+1, -1, -0.5] (padding holds nan);
    trainer - sampler = [0, ln 3, -ln 2] with cap 2 -> ratios [1, 2 (clipped from 3), 0.5]."""
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    student_BT = torch.tensor([[9.0, -1.0, -2.0], [9.0, -1.0, 9.0]])
    teacher_BT = torch.tensor([[9.0, 0.0, -3.0], [9.0, -1.5, float("nan")]])
    sampler_BT = student_BT - torch.tensor([[5.0, 0.0, math.log(3.0)], [5.0, -math.log(2.0), 5.0]])
    rewards_B = torch.tensor([1.0, 0.0])
    advantage_BT = cure_advantage(teacher_BT, student_BT, mask_BT, rewards_B, torch.tensor([0, 0]), torch.ones(2, dtype=torch.float64),
                                  lambda_opd=1.0, lambda_rl=1.0)[0]

    metrics = opd_metrics(teacher_BT, student_BT, mask_BT, sampler_BT, cap=2.0, advantage_BT=advantage_BT, rewards_B=rewards_B)

    assert set(metrics) == {
        "tokens/completion",
        "opd/reverse_kl",
        "opd/teacher_logprob_mean",
        "opd/student_logprob_mean",
        "opd/advantage_mean",
        "opd/advantage_std",
        "opd/positive_advantage_share",
        "is/ratio_mean",
        "is/ratio_max",
        "is/clipped_share",
        "is/sampler_logprob_abs_diff",
        "loss/advantage_mean",
        "loss/advantage_std",
        "reward/mean",
    }
    assert all(type(value) is float for value in metrics.values())
    advantages = [1.0, -1.0, -0.5]
    mean = sum(advantages) / 3
    expected = {
        "tokens/completion": 3.0,
        "opd/reverse_kl": 0.5 / 3,
        "opd/teacher_logprob_mean": -4.5 / 3,
        "opd/student_logprob_mean": -4.0 / 3,
        "opd/advantage_mean": -0.5 / 3,
        "opd/advantage_std": math.sqrt(sum((a - mean) ** 2 for a in advantages) / 3),
        "opd/positive_advantage_share": 1 / 3,
        "is/ratio_mean": (1 + 2 + 0.5) / 3,
        "is/ratio_max": 3.0,
        "is/clipped_share": 1 / 3,
        "is/sampler_logprob_abs_diff": (0 + math.log(3) + math.log(2)) / 3,
        # GRPO on rewards (1, 0) in one group: +1 for sequence 0, -1 for sequence 1 (up to eps)
        "loss/advantage_mean": ((1 + 1) + (1 - 1) + (-1 - 0.5)) / 3,
        "loss/advantage_std": math.sqrt(((2 - 1 / 6) ** 2 + (0 - 1 / 6) ** 2 + (-1.5 - 1 / 6) ** 2) / 3),
        "reward/mean": 0.5,
    }
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key

    no_sampler = opd_metrics(teacher_BT, student_BT, mask_BT)
    assert not any(key.startswith(("is/", "loss/", "reward/")) for key in no_sampler)
    assert opd_metrics(teacher_BT, student_BT, mask_BT, sampler_BT)["is/clipped_share"] == 0.0  # cap None
    empty = opd_metrics(teacher_BT, student_BT, torch.zeros_like(mask_BT))
    assert empty["tokens/completion"] == 0.0 and math.isnan(empty["opd/reverse_kl"])
