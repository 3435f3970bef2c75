"""selfopd.training.loss: the sign, the expected gradient, masking and normalisation of the OPD loss,
each pinned against a float64 reference written straight from the definition."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from selfopd.config import ConfigError, LossConfig
from selfopd.training.advantages import (cure_advantage, grpo_advantage, mean_prompt_weight, opd_advantage,
                                         opd_rollout_weights, rlsd_lambda)
from selfopd.training.loss import (LossInputs, clipped_divergence, clipped_tokens, opd_loss, policy_gradient_loss,
                                   truncated_is_ratio)


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token], plainly: the student of the loss tests below."""
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)


def combined_advantage(teacher_BT, student_BT, mask_BT, rewards_B=None, group_ids_B=None, lambda_opd=1.0, lambda_rl=0.0,
                       token_clip=0.0):
    """`cure_advantage` with every cure off: lambda_rl * A_grpo + lambda_opd * clip(teacher - student)."""
    B = mask_BT.shape[0]
    rewards_B = torch.zeros(B) if rewards_B is None else rewards_B
    group_ids_B = torch.arange(B) if group_ids_B is None else group_ids_B
    return cure_advantage(teacher_BT, student_BT, mask_BT, rewards_B, group_ids_B, torch.ones(B, dtype=torch.float64),
                          lambda_opd, lambda_rl, token_clip=token_clip)[0]

torch.set_num_threads(1)  # the test machine's cores are shared; these tensors are tiny anyway


def _completion_logprobs(model: LlamaForCausalLM, ids_BT: torch.Tensor) -> torch.Tensor:
    """Logprob of each token given its prefix, aligned with ids (position 0 gets 0)."""
    logits_BTV = model(input_ids=ids_BT).logits
    lp_BT = token_logprobs(logits_BTV[:, :-1], ids_BT[:, 1:])
    return torch.cat([torch.zeros_like(lp_BT[:, :1]), lp_BT], dim=1)


def _reference_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV.double(), dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)


# ---- sign and expected gradient -----------------------------------------------------------


def test_one_adamw_step_moves_each_token_toward_the_teacher():
    """Free logits per position (positions do not interact): after one step the student's
    logprob rises exactly where the teacher's is higher, falls where it is lower, and prompt
    positions do not move at all."""
    torch.manual_seed(1)
    B, T, V = 2, 6, 5
    logits_BTV = torch.nn.Parameter(torch.randn(B, T, V))
    tokens_BT = torch.randint(0, V, (B, T))
    mask_BT = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    delta_BT = torch.tensor([[5.0, -5.0, 0.7, -0.4, 0.2, -1.0], [3.0, -0.3, 0.5, 0.0, -0.9, 2.0]])
    optimizer = torch.optim.AdamW([logits_BTV], lr=1e-2, weight_decay=0.0)

    before_BT = token_logprobs(logits_BTV, tokens_BT).detach()
    teacher_BT = before_BT + delta_BT
    student_BT = token_logprobs(logits_BTV, tokens_BT)
    advantage_BT = opd_advantage(teacher_BT, student_BT, mask_BT)
    policy_gradient_loss(student_BT, advantage_BT, mask_BT).backward()
    optimizer.step()
    change_BT = token_logprobs(logits_BTV, tokens_BT).detach() - before_BT

    trained = mask_BT & (delta_BT != 0)
    assert torch.equal(torch.sign(change_BT[trained]), torch.sign(delta_BT[trained]))
    assert torch.all(change_BT[~mask_BT] == 0)  # prompt and padding untouched
    assert torch.all(change_BT[mask_BT & (delta_BT == 0)] == 0)  # zero advantage, zero move


@pytest.mark.parametrize("teacher_offset", [+2.0, -2.0])
def test_one_sgd_step_on_a_real_model_follows_the_teacher(tiny_llama, teacher_offset):
    """A whole causal LM: one completion token, the teacher above (below) the student on it;
    one SGD step raises (lowers) the student's logprob of that token."""
    model = LlamaForCausalLM(tiny_llama.config)
    model.load_state_dict(tiny_llama.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids_BT = torch.tensor([[3, 17, 42, 8, 25, 11]])
    mask_BT = torch.tensor([[0, 0, 0, 0, 1, 0]], dtype=torch.bool)

    student_BT = _completion_logprobs(model, ids_BT)
    teacher_BT = student_BT.detach() + teacher_offset
    loss = policy_gradient_loss(student_BT, opd_advantage(teacher_BT, student_BT, mask_BT), mask_BT)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after_BT = _completion_logprobs(model, ids_BT)
    change = (after_BT - student_BT.detach())[0, 4].item()
    assert math.copysign(1.0, change) == math.copysign(1.0, teacher_offset)
    assert abs(change) > 1e-6


def _expected_loss_gradient(theta_K: torch.Tensor, log_q_K: torch.Tensor, log_mu_K: torch.Tensor | None) -> torch.Tensor:
    """Exact expectation of the sampled-token loss gradient: enumerate the K outcomes,
    weighted by the sampling distribution (the policy itself, or mu with IS ratios)."""
    K = theta_K.numel()
    log_pi_K = torch.log_softmax(theta_K.detach(), dim=0)
    log_sample_K = log_pi_K if log_mu_K is None else log_mu_K
    expected_K = torch.zeros_like(theta_K)
    for k in range(K):
        theta = theta_K.detach().clone().requires_grad_(True)
        tokens_BT = torch.tensor([[k]])
        logpi_BT = token_logprobs(theta[None, None, :], tokens_BT)  # (1, 1)
        mask_BT = torch.ones(1, 1, dtype=torch.bool)
        advantage_BT = opd_advantage(log_q_K[k].view(1, 1), logpi_BT, mask_BT)
        ratio_BT = None if log_mu_K is None else truncated_is_ratio(logpi_BT, log_mu_K[k].view(1, 1), cap=None)
        policy_gradient_loss(logpi_BT, advantage_BT, mask_BT, ratio_BT).backward()
        expected_K += log_sample_K[k].exp() * theta.grad
    return expected_K


@pytest.mark.parametrize("off_policy", [False, True])
def test_expected_gradient_equals_reverse_kl_gradient(off_policy):
    """E_y[grad loss] = grad KL(pi || q) = sum_k pi_k (log pi_k - log q_k)(e_k - pi), exactly
    (float64), on policy and with an untruncated IS ratio from a different sampler mu."""
    torch.manual_seed(2)
    K = 7
    theta_K = torch.randn(K, dtype=torch.float64)
    log_q_K = torch.log_softmax(torch.randn(K, dtype=torch.float64), dim=0)
    log_mu_K = torch.log_softmax(torch.randn(K, dtype=torch.float64), dim=0) if off_policy else None

    expected_K = _expected_loss_gradient(theta_K, log_q_K, log_mu_K)

    pi_K = torch.softmax(theta_K, dim=0)
    analytic_K = sum(pi_K[k] * (pi_K[k].log() - log_q_K[k]) * (torch.eye(K, dtype=torch.float64)[k] - pi_K) for k in range(K))
    theta = theta_K.clone().requires_grad_(True)
    log_pi = torch.log_softmax(theta, dim=0)
    (log_pi.exp() * (log_pi - log_q_K)).sum().backward()  # KL(pi || q), straight from the definition
    assert torch.allclose(theta.grad, analytic_K, rtol=0, atol=1e-12)
    assert torch.allclose(expected_K, analytic_K, rtol=0, atol=1e-10)
    assert analytic_K.abs().max() > 1e-2  # not a trivially zero case


# ---- zero advantage and masking -----------------------------------------------------------


def test_identical_teacher_and_student_give_exactly_zero_advantage_and_gradient(tiny_llama):
    """The empty-context self teacher scores the same ids with the same weights: the
    advantage must be exactly 0 and the loss must not move the model."""
    model = LlamaForCausalLM(tiny_llama.config)
    model.load_state_dict(tiny_llama.state_dict())
    ids_BT = torch.tensor([[5, 9, 33, 2, 14, 60, 7], [1, 48, 22, 22, 3, 19, 40]])
    mask_BT = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    student_BT = _completion_logprobs(model, ids_BT)
    with torch.no_grad():
        teacher_BT = _completion_logprobs(model, ids_BT)  # self teacher, empty context
    for teacher in (student_BT.detach().clone(), teacher_BT):
        advantage_BT = opd_advantage(teacher, student_BT, mask_BT)
        assert torch.equal(advantage_BT, torch.zeros_like(advantage_BT))
        assert not advantage_BT.requires_grad  # a constant weight, never differentiated
        assert not combined_advantage(teacher, student_BT, mask_BT).requires_grad
        model.zero_grad()
        loss = policy_gradient_loss(student_BT, advantage_BT, mask_BT, normalisation="sequence")
        loss.backward(retain_graph=True)
        assert loss.item() == 0.0
        for name, parameter in model.named_parameters():
            assert parameter.grad is None or torch.equal(parameter.grad, torch.zeros_like(parameter.grad)), name


@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_prompt_and_padding_positions_get_exactly_zero_gradient(normalisation):
    """Masked positions hold garbage (inf, nan, huge ratios), as padding does in practice:
    the loss stays finite and their logits get exactly zero gradient."""
    torch.manual_seed(3)
    B, T, V = 3, 5, 6
    tokens_BT = torch.randint(0, V, (B, T))
    logits_BTV = torch.randn(B, T, V)
    logits_BTV[0, 4, tokens_BT[0, 4]] = float("-inf")  # padding token scored -inf: logpi = -inf
    logits_BTV.requires_grad_(True)
    mask_BT = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    student_BT = token_logprobs(logits_BTV, tokens_BT)
    assert torch.isinf(student_BT[0, 4])
    garbage_BT = torch.where(mask_BT, torch.zeros(B, T), torch.tensor(float("nan")))
    teacher_BT = student_BT.detach() + torch.randn(B, T) + garbage_BT
    teacher_BT[0, 4] = float("-inf")
    sampler_BT = student_BT.detach() + 0.1 * torch.randn(B, T)
    sampler_BT[1, 0] = -1e6  # ratio exp(1e6) = inf off the mask
    ratio_BT = truncated_is_ratio(student_BT, sampler_BT, cap=None)
    assert torch.isinf(ratio_BT[1, 0])
    advantage_BT = opd_advantage(teacher_BT, student_BT, mask_BT)
    loss = policy_gradient_loss(student_BT, advantage_BT, mask_BT, ratio_BT, normalisation=normalisation)
    loss.backward()
    assert torch.isfinite(loss)
    grad_BTV = logits_BTV.grad
    assert torch.all(grad_BTV[~mask_BT] == 0)
    assert torch.all(grad_BTV[mask_BT].abs().sum(-1) > 0)


# ---- normalisation ------------------------------------------------------------------------


def test_token_mean_and_sequence_mean_weigh_long_sequences_differently():
    """Lengths 1 and 3, terms A * logpi = [2] and [1, 1, 1]:
    token mean    -(2 + 1 + 1 + 1) / 4       = -1.25, each token weight 1/4;
    sequence mean -(2/1 + 3/3) / 2           = -1.5, weights 1/2 and 1/6;
    a third, empty sequence changes neither."""
    logpi_BT = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0], [7.0, 7.0, 7.0]], dtype=torch.float64, requires_grad=True)
    advantage_BT = torch.tensor([[1.0, 5.0, 5.0], [1.0, 1.0, 1.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)

    token = policy_gradient_loss(logpi_BT, advantage_BT, mask_BT, normalisation="token")
    (grad_token,) = torch.autograd.grad(token, logpi_BT)
    sequence = policy_gradient_loss(logpi_BT, advantage_BT, mask_BT, normalisation="sequence")
    (grad_sequence,) = torch.autograd.grad(sequence, logpi_BT)

    assert token.item() == -1.25
    assert sequence.item() == -1.5
    assert torch.allclose(grad_token, -torch.tensor([[1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4], [0, 0, 0]], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(grad_sequence, -torch.tensor([[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6], [0, 0, 0]], dtype=torch.float64), atol=1e-15)
    with pytest.raises(ValueError):
        policy_gradient_loss(logpi_BT, advantage_BT, mask_BT, normalisation="batch")  # type: ignore[arg-type]


# ---- truncated importance sampling --------------------------------------------------------


def test_truncated_is_ratio_is_capped_one_on_agreement_and_detached():
    trainer_BT = torch.tensor([[0.0, -1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    sampler_BT = torch.tensor([[0.0, -2.0, -1.0, -3.0]], dtype=torch.float64)
    ratio_BT = truncated_is_ratio(trainer_BT, sampler_BT, cap=2.0)
    assert torch.equal(ratio_BT, torch.tensor([[1.0, 2.0, math.exp(-1.0), 2.0]], dtype=torch.float64))
    uncapped_BT = truncated_is_ratio(trainer_BT, sampler_BT, cap=None)
    assert torch.allclose(uncapped_BT, torch.tensor([[1.0, math.e, math.exp(-1.0), math.exp(2.5)]], dtype=torch.float64))
    assert not ratio_BT.requires_grad and not uncapped_BT.requires_grad

    # Ratio built from the very logprobs being trained: the gradient is ratio * A / N, with
    # no d(ratio)/d(logpi) term (which would add ratio * A * logpi / N).
    advantage_BT = torch.tensor([[0.5, -1.0, 2.0, 1.0]], dtype=torch.float64)
    mask_BT = torch.ones(1, 4, dtype=torch.bool)
    loss = policy_gradient_loss(trainer_BT, advantage_BT, mask_BT, truncated_is_ratio(trainer_BT, sampler_BT, cap=2.0))
    (grad_BT,) = torch.autograd.grad(loss, trainer_BT)
    assert torch.allclose(grad_BT, -ratio_BT * advantage_BT / 4, rtol=0, atol=1e-15)


# ---- GRPO and the combined advantage ------------------------------------------------------


def test_grpo_advantage_is_group_normalised():
    """Groups in any order and of any size; reference written as a plain loop in float64."""
    rewards_N = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.9, 0.9, 1.0, 0.5, 0.0, 2.0])
    group_ids_N = torch.tensor([7, 3, 7, 3, 9, 9, 9, 7, 4, 7, 3])
    advantage_N = grpo_advantage(rewards_N, group_ids_N, eps=1e-6)

    expected_N = torch.empty_like(rewards_N, dtype=torch.float64)
    for group in group_ids_N.unique():
        members = (group_ids_N == group).nonzero().flatten().tolist()
        values = [rewards_N[i].item() for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for i in members:
            expected_N[i] = (rewards_N[i].item() - mean) / (std + 1e-6)
    assert torch.allclose(advantage_N.double(), expected_N, rtol=0, atol=1e-6)

    for group in (7, 3):  # rewards vary: zero mean, unit (population) std up to eps
        in_group = advantage_N[group_ids_N == group].double()
        assert abs(in_group.mean().item()) < 1e-6
        assert abs(in_group.std(correction=0).item() - 1) < 1e-5
    # All-equal rewards and a group of one: exactly 0, never nan. In float32 the mean of
    # three 0.9s is off by 6e-8, which divided by (std + eps) would leave 0.06, not 0.
    assert torch.equal(advantage_N[group_ids_N == 9], torch.zeros(3))
    assert advantage_N[8].item() == 0.0
    assert torch.equal(grpo_advantage(torch.tensor([1, 1]), torch.tensor([0, 0]), eps=0.0), torch.zeros(2))  # 0/0


def test_advantage_with_every_cure_off_is_the_weighted_sum():
    torch.manual_seed(4)
    B, T = 4, 5
    teacher_BT, student_BT = torch.randn(B, T), torch.randn(B, T)
    mask_BT = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    rewards_B, group_ids_B = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])

    combined_BT = combined_advantage(teacher_BT, student_BT, mask_BT, rewards_B, group_ids_B, lambda_opd=0.7, lambda_rl=0.3)
    grpo_BT = grpo_advantage(rewards_B, group_ids_B)[:, None] * mask_BT
    opd_BT = opd_advantage(teacher_BT, student_BT, mask_BT)
    assert torch.equal(combined_BT, 0.3 * grpo_BT + 0.7 * opd_BT)
    assert torch.equal(combined_BT[~mask_BT], torch.zeros(int((~mask_BT).sum())))
    assert torch.allclose(grpo_BT[0, 1:4], torch.ones(3), atol=1e-5)  # +1 up to eps, on each completion token
    assert torch.equal(combined_advantage(teacher_BT, student_BT, mask_BT), opd_BT)  # pure OPD default


def test_token_clip_clips_the_opd_term_before_weighting_and_gives_its_gradient():
    """Reference in float64, token by token from the definition: A = lambda_rl * A_grpo +
    lambda_opd * min(max(teacher - student, -c), c); the loss gradient is -A / tokens."""
    torch.manual_seed(5)
    B, T, c = 4, 6, 0.5
    teacher_BT, student_BT = 2 * torch.randn(B, T), 2 * torch.randn(B, T)
    mask_BT = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]],
                           dtype=torch.bool)
    teacher_BT[0, 0] = math.inf  # a prompt position's garbage stays out
    rewards_B, group_ids_B = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    grpo_B = grpo_advantage(rewards_B, group_ids_B).double()
    expected_BT = torch.zeros(B, T, dtype=torch.float64)
    clipped = 0
    for b in range(B):
        for t in range(T):
            if mask_BT[b, t]:
                gap = float(teacher_BT[b, t]) - float(student_BT[b, t])
                clipped += abs(gap) > c
                expected_BT[b, t] = 0.3 * grpo_B[b] + 0.7 * min(max(gap, -c), c)
    assert 0 < clipped < int(mask_BT.sum())  # the data clips some tokens, not all
    logpi_BT = student_BT.clone().requires_grad_(True)
    advantage_BT = combined_advantage(teacher_BT, logpi_BT, mask_BT, rewards_B, group_ids_B, lambda_opd=0.7,
                                      lambda_rl=0.3, token_clip=c)
    assert torch.allclose(advantage_BT.double(), expected_BT, rtol=0, atol=1e-6)
    policy_gradient_loss(logpi_BT, advantage_BT, mask_BT).backward()
    assert torch.allclose(logpi_BT.grad.double(), -expected_BT / int(mask_BT.sum()), rtol=0, atol=1e-7)
    share = clipped_tokens(teacher_BT - student_BT, mask_BT, c, two_sided=True)
    assert int(share.sum()) == clipped and not share[~mask_BT].any()
    unclipped = combined_advantage(teacher_BT, student_BT, mask_BT, rewards_B, group_ids_B, 0.7, 0.3, token_clip=0.0)
    assert torch.equal(unclipped, combined_advantage(teacher_BT, student_BT, mask_BT, rewards_B, group_ids_B, 0.7, 0.3))
    assert not clipped_tokens(teacher_BT - student_BT, mask_BT, 0.0, two_sided=True).any()


def test_token_clip_clamps_a_divergence_and_drops_the_gradient_of_clamped_positions():
    """The clamped divergence equals min(d, c) and its gradient is d's where d <= c, 0 where
    clamped (float64 reference by finite pieces: the gradient of sum(w * min(d, c)))."""
    torch.manual_seed(6)
    x_N = torch.randn(12, dtype=torch.float64, requires_grad=True)
    divergence_N = x_N**2  # >= 0, like every divergence here; its gradient is 2x
    c = 0.6
    weights_N = torch.rand(12, dtype=torch.float64)
    clamped_N = clipped_divergence(divergence_N, c)
    (weights_N * clamped_N).sum().backward()
    d = divergence_N.detach()
    assert torch.equal(clamped_N.detach(), torch.minimum(d, torch.tensor(c, dtype=torch.float64)))
    expected_grad = torch.where(d > c, torch.zeros_like(d), weights_N * 2 * x_N.detach())
    assert 0 < int((d > c).sum()) < 12
    assert torch.equal(x_N.grad, expected_grad)
    mask_N = torch.ones(12, dtype=torch.bool)
    assert torch.equal(clipped_tokens(d, mask_N, c, two_sided=False), d > c)
    assert clipped_divergence(divergence_N, 0.0) is divergence_N


# ---- the assembled loss, every allowed combination of settings ----------------------------

SETTING_VALUES = {
    "divergence": ["sampled", "topk_reverse_kl", "reverse_kl", "forward_kl", "jsd"],
    "lambda_opd": [0.0, 0.7],
    "lambda_rl": [0.0, 0.5],
    "rlsd_weight": [0.0, 0.5],
    "opd_on": ["all", "failed"],
    "pass_rate_weighting": [False, True],
    "opd_baseline": ["student", "wrong_context", "same_engine"],
    "token_clip": [0.0, 0.3],
    "is_cap": [0.0, 2.0],
    "normalisation": ["token", "sequence"],
}
STEP, TOP_K, BETA, EPS, TAIL_FLOOR = 3, 2, 0.3, 1e-6, 1e-6


def _allowed_settings(divergence: str) -> list[LossConfig]:
    """Every combination of SETTING_VALUES with this divergence that the config accepts."""
    allowed = []
    names = [n for n in SETTING_VALUES if n != "divergence"]
    for values in itertools.product(*(SETTING_VALUES[n] for n in names)):
        try:
            allowed.append(LossConfig(divergence=divergence, top_k=TOP_K, jsd_beta=BETA, rlsd_decay_steps=10,
                                      **dict(zip(names, values))))
        except ConfigError:
            pass
    return allowed


def _micro_batch(seed: int = 0) -> dict:
    """Two prompt groups of two rollouts (rewards mixed in group 0, all wrong in group 1),
    ragged completions, a student and a teacher given by hidden states and heads, float64."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = 4, 3, 4, 6
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return {
        "hidden_BTH": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "head_VH": torch.randn(V, H, generator=g, dtype=torch.float64),
        "teacher_hidden_BTH": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "teacher_head_VH": torch.randn(V, H, generator=g, dtype=torch.float64),
        "tokens_BT": torch.randint(0, V, (B, T), generator=g),
        "sampler_noise_BT": 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "baseline_lp_BT": -2 * torch.rand(B, T, generator=g, dtype=torch.float64),
        "mask_BT": mask_BT,
        "correct_B": torch.tensor([True, False, False, False]),
        "group_ids_B": torch.tensor([7, 7, 3, 3]),
    }


def _library_loss(batch: dict, settings: LossConfig) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """opd_loss on the batch, the inputs built as the trainer builds them; (loss, d loss / d (hidden, head))."""
    hidden_BTH = batch["hidden_BTH"].clone().requires_grad_(True)
    head_VH = batch["head_VH"].clone().requires_grad_(True)
    tokens_BT, mask_BT = batch["tokens_BT"], batch["mask_BT"]
    student_lp_BT = token_logprobs(hidden_BTH @ head_VH.T, tokens_BT)
    teacher_all_BTV = torch.log_softmax(batch["teacher_hidden_BTH"] @ batch["teacher_head_VH"].T, dim=-1)
    correct_B, group_ids_B = batch["correct_B"], batch["group_ids_B"]
    total, prompts = mean_prompt_weight(correct_B, group_ids_B)
    topk_BTK = teacher_all_BTV.topk(TOP_K, dim=-1)
    inputs = LossInputs(
        student_lp_BT=student_lp_BT,
        teacher_lp_BT=teacher_all_BTV.gather(-1, tokens_BT[..., None]).squeeze(-1),
        sampler_lp_BT=student_lp_BT.detach() + batch["sampler_noise_BT"],
        mask_BT=mask_BT,
        rewards_B=correct_B.double(),
        group_ids_B=group_ids_B,
        opd_weight_B=opd_rollout_weights(correct_B, group_ids_B, settings.opd_on, settings.pass_rate_weighting,
                                         total / prompts),
        rlsd_lambda=rlsd_lambda(STEP, settings.rlsd_weight, settings.rlsd_decay_steps),
        baseline_lp_BT=batch["baseline_lp_BT"] if settings.opd_baseline != "student" else None,
        student_hidden_BTH=hidden_BTH,
        student_head_VH=head_VH,
        teacher_topk=(topk_BTK.indices, topk_BTK.values),
        teacher_states=(batch["teacher_hidden_BTH"], batch["teacher_head_VH"]),
    )
    loss = opd_loss(inputs, settings).loss
    return loss.detach(), torch.autograd.grad(loss, (hidden_BTH, head_VH), allow_unused=True)


def _reference_loss(batch: dict, settings: LossConfig) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The loss written from the formula in `selfopd.training.loss`'s docstring, token by token
    in float64, with every constant (advantage, ratio, weights) taken as a python float."""
    s = settings
    hidden_BTH = batch["hidden_BTH"].clone().requires_grad_(True)
    head_VH = batch["head_VH"].clone().requires_grad_(True)
    student_all = torch.log_softmax(hidden_BTH @ head_VH.T, dim=-1)
    teacher_all = torch.log_softmax(batch["teacher_hidden_BTH"] @ batch["teacher_head_VH"].T, dim=-1)
    tokens, mask = batch["tokens_BT"].tolist(), batch["mask_BT"].tolist()
    correct, groups = batch["correct_B"].tolist(), batch["group_ids_B"].tolist()
    B, T = len(tokens), len(tokens[0])

    def group_of(b):
        return [i for i in range(B) if groups[i] == groups[b]]

    def paid(i):  # loss.wrong_reward for a wrong rollout
        return 1.0 if correct[i] else s.wrong_reward

    def grpo(b):
        rewards = [paid(i) for i in group_of(b)]
        mean = sum(rewards) / len(rewards)
        if s.rl_advantage == "raw":
            return paid(b)
        if max(rewards) == min(rewards):
            return 0.0
        if s.rl_advantage == "group_mean":
            return paid(b) - mean
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        return (paid(b) - mean) / (std + EPS)

    def pass_weight(b):
        p = sum(correct[i] for i in group_of(b)) / len(group_of(b))
        return math.sqrt(p * (1 - p))

    prompts = sorted(set(groups))
    mean_pass = sum(pass_weight(groups.index(g)) for g in prompts) / len(prompts)
    lam = s.rlsd_weight * max(0.0, 1 - STEP / s.rlsd_decay_steps)

    def weight(b):
        w = 0.0 if (s.opd_on == "failed" and correct[b]) else 1.0
        if s.pass_rate_weighting:
            w *= pass_weight(b) / mean_pass if mean_pass > 0 else 0.0
        return w

    def divergence(b, t):
        p, q = student_all[b, t].exp(), teacher_all[b, t].exp()
        if s.divergence in ("reverse_kl", "forward_kl", "jsd"):
            return entry_terms(p, q).sum()
        top = teacher_all[b, t].detach().topk(TOP_K).indices.tolist()
        rest = [v for v in range(p.numel()) if v not in top]
        student_buckets = torch.stack([p[v] for v in top] + [p[rest].sum()])
        teacher_top = [q[v].item() for v in top]
        teacher_buckets = torch.tensor(teacher_top + [max(1 - sum(teacher_top), TAIL_FLOOR)], dtype=torch.float64)
        return (student_buckets * (student_buckets.log() - teacher_buckets.log())).sum()

    def entry_terms(p, q):  # (V,) the full-vocabulary divergence's term of each vocabulary entry
        if s.divergence == "reverse_kl":
            return p * (p.log() - q.log())
        if s.divergence == "forward_kl":
            return q * (q.log() - p.log())
        m = BETA * q + (1 - BETA) * p
        return BETA * q * (q.log() - m.log()) + (1 - BETA) * p * (p.log() - m.log())

    pg_terms, opd_terms = [[] for _ in range(B)], [[] for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            student_lp = student_all[b, t, tokens[b][t]]
            teacher_lp = teacher_all[b, t, tokens[b][t]].item()
            baseline = student_lp.item() if s.opd_baseline == "student" else batch["baseline_lp_BT"][b, t].item()
            signal = teacher_lp - baseline
            a_grpo = grpo(b)
            rlsd = 1.0
            if lam and a_grpo:
                rlsd = (1 - lam) + lam * min(max(math.exp(math.copysign(1, a_grpo) * signal), 1 - s.rlsd_clip),
                                             1 + s.rlsd_clip)
            clipped_signal = max(-s.token_clip, min(s.token_clip, signal)) if s.token_clip else signal
            ratio = 1.0
            if s.is_cap:
                ratio = min(math.exp(-batch["sampler_noise_BT"][b, t].item()), s.is_cap)
            rl_part = s.lambda_rl * a_grpo * rlsd
            if s.divergence == "sampled":
                pg_terms[b].append(-ratio * (rl_part + s.lambda_opd * weight(b) * clipped_signal) * student_lp)
            else:
                pg_terms[b].append(-ratio * rl_part * student_lp)
                if s.clip_per == "vocabulary_entry":  # each entry's term capped, a capped one a constant
                    d = entry_terms(student_all[b, t].exp(), teacher_all[b, t].exp()).clamp(max=s.token_clip).sum()
                else:
                    d = divergence(b, t)
                    if s.token_clip and d.item() > s.token_clip:
                        d = torch.tensor(s.token_clip, dtype=torch.float64)  # clamped: a constant
                opd_terms[b].append(s.lambda_opd * weight(b) * d)

    def mean(terms):
        rows = [row for row in terms if row]
        if s.normalisation == "token":
            return sum(x for row in rows for x in row) / sum(len(row) for row in rows)
        return sum(sum(row) / len(row) for row in rows) / len(rows)

    loss = mean(pg_terms) + (mean(opd_terms) if s.divergence != "sampled" else 0.0)
    return loss.detach(), torch.autograd.grad(loss, (hidden_BTH, head_VH), allow_unused=True)


@pytest.mark.parametrize("divergence", SETTING_VALUES["divergence"])
def test_assembled_loss_matches_float64_reference_for_every_allowed_setting(divergence):
    """The loss of one micro-batch and its gradient in the student's hidden states and head,
    for every combination of settings the config accepts, against a token-by-token float64
    reference written from the docstring's formula: a wrong sign, weight, clip, ratio or
    reduction anywhere in the assembly shows up here even where each part is right."""
    batch = _micro_batch()
    combos = _allowed_settings(divergence)
    assert len(combos) >= (120 if divergence == "sampled" else 40)  # the grid is not silently empty
    clipped_somewhere = False
    for settings in combos:
        loss, grads = _library_loss(batch, settings)
        expected, expected_grads = _reference_loss(batch, settings)
        label = {n: getattr(settings, n) for n in SETTING_VALUES}
        assert loss.item() == pytest.approx(expected.item(), abs=1e-10), label
        for grad, reference in zip(grads, expected_grads):
            grad = torch.zeros_like(reference) if grad is None else grad
            reference = torch.zeros_like(grad) if reference is None else reference
            assert torch.allclose(grad, reference, rtol=1e-8, atol=1e-10), label
        clipped_somewhere |= settings.token_clip > 0 and loss.item() != _library_loss(
            batch, dataclasses.replace(settings, token_clip=0.0))[0].item()
    assert clipped_somewhere  # the clip acts on this data


# The GRPO term's advantage and reward, and the per-vocabulary-entry cap: a grid of their own
# (crossing them with every setting above would multiply its time by twelve).
NEW_SETTING_VALUES = {
    "rl_advantage": ["group_norm", "group_mean", "raw"],
    "wrong_reward": [0.0, -1.0],
    "partial_credit": [False, True],  # only what it allows: wrong_reward under group_norm
    "clip_per": ["position", "vocabulary_entry"],
    "token_clip": [0.0, 0.3],
    "lambda_opd": [0.0, 0.7],
    "lambda_rl": [0.0, 0.5],
    "rlsd_weight": [0.0, 0.5],
}


@pytest.mark.parametrize("divergence", SETTING_VALUES["divergence"])
def test_assembled_loss_matches_float64_reference_for_the_grpo_baseline_and_entry_clip(divergence):
    """loss.rl_advantage, loss.wrong_reward and loss.clip_per, with the weights, RLSD and the
    clip they interact with, against the token-by-token reference: group 1 of the micro-batch is
    all wrong, so 'raw' with wrong_reward -1 pushes it down where the default leaves it at 0."""
    batch = _micro_batch(seed=1)
    names = list(NEW_SETTING_VALUES)
    combos = []
    for values in itertools.product(*(NEW_SETTING_VALUES[n] for n in names)):
        try:
            combos.append(LossConfig(divergence=divergence, top_k=TOP_K, jsd_beta=BETA, rlsd_decay_steps=10,
                                     **dict(zip(names, values))))
        except ConfigError:
            pass
    kinds = {(c.rl_advantage, c.wrong_reward, c.clip_per) for c in combos}
    # 6 kinds of GRPO term (group_norm with -1 only beside partial credit), each per entry too for a full vocabulary
    assert len(kinds) == (12 if divergence in ("reverse_kl", "forward_kl", "jsd") else 6)
    entry_acts = raw_acts = False
    for settings in combos:
        loss, grads = _library_loss(batch, settings)
        expected, expected_grads = _reference_loss(batch, settings)
        label = {n: getattr(settings, n) for n in names}
        assert loss.item() == pytest.approx(expected.item(), abs=1e-10), label
        for grad, reference in zip(grads, expected_grads):
            grad = torch.zeros_like(reference) if grad is None else grad
            reference = torch.zeros_like(grad) if reference is None else reference
            assert torch.allclose(grad, reference, rtol=1e-8, atol=1e-10), label
        default = dataclasses.replace(settings, rl_advantage="group_norm", wrong_reward=0.0, clip_per="position")
        moved = loss.item() != _library_loss(batch, default)[0].item()
        entry_acts |= settings.clip_per == "vocabulary_entry" and moved
        raw_acts |= settings.rl_advantage == "raw" and moved
    assert raw_acts and (entry_acts or divergence not in ("reverse_kl", "forward_kl", "jsd"))


def test_raw_advantage_pushes_down_an_all_wrong_group():
    """The GRPO term alone (lambda_opd 0): under 'raw' with wrong_reward -1 every token of the all-wrong
    group has advantage -1 and the loss's gradient lowers its tokens' logprobs; the default gives
    that group advantage 0 exactly."""
    batch = _micro_batch()
    wrong = batch["group_ids_B"] == 3  # rollouts 2 and 3: both wrong
    for settings, expected in ((LossConfig(lambda_opd=0.0, lambda_rl=1.0, rl_advantage="raw", wrong_reward=-1.0, is_cap=0.0), -1.0),
                               (LossConfig(lambda_opd=0.0, lambda_rl=1.0, is_cap=0.0), 0.0)):
        hidden_BTH = batch["hidden_BTH"].clone().requires_grad_(True)
        student_lp_BT = token_logprobs(hidden_BTH @ batch["head_VH"].T, batch["tokens_BT"])
        mask_BT = batch["mask_BT"]
        inputs = LossInputs(student_lp_BT=student_lp_BT, teacher_lp_BT=torch.zeros_like(student_lp_BT),
                            sampler_lp_BT=student_lp_BT.detach(), mask_BT=mask_BT,
                            rewards_B=batch["correct_B"].double(), group_ids_B=batch["group_ids_B"],
                            opd_weight_B=torch.ones(4, dtype=torch.float64))
        parts = opd_loss(inputs, settings)
        on_wrong = mask_BT & wrong[:, None]
        assert torch.equal(parts.advantage_BT[on_wrong], torch.full((int(on_wrong.sum()),), expected, dtype=torch.float64))
        # d loss / d logprob of a token = -A / (number of completion tokens): positive under 'raw', so descent lowers it
        (grad_lp_BT,) = torch.autograd.grad(parts.loss, student_lp_BT)
        assert torch.allclose(grad_lp_BT[on_wrong], torch.full_like(grad_lp_BT[on_wrong], -expected / int(mask_BT.sum())),
                              rtol=1e-12, atol=0)
