"""selfopd.training.objectives: the sign, the expected gradient, masking and normalisation of the OPD loss,
each pinned against a float64 reference written straight from the definition."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.training.loss_metrics import opd_metrics
from selfopd.training.objectives import (
    clipped_divergence,
    clipped_tokens,
    combined_advantage,
    grpo_advantage,
    opd_advantage,
    policy_gradient_loss,
    truncated_is_ratio,
)


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token], plainly: the student of the loss tests below."""
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)

torch.set_num_threads(1)  # the test machine's cores are shared; these tensors are tiny anyway


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (vocab 64): a real causal LM, no download."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float().eval()


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


def test_combined_advantage_is_the_weighted_sum():
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
    with pytest.raises(ValueError, match="rewards"):
        combined_advantage(teacher_BT, student_BT, mask_BT, lambda_rl=1.0)


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


# ---- token logprobs -----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 100])
def test_chunked_token_logprobs_match_float64_reference(chunk_size):
    """T = 7: chunk sizes 3 and 4 do not divide it, 100 exceeds it. Values and gradients in
    hidden states and weight, against log_softmax of the float64 logits."""
    torch.manual_seed(5)
    B, T, H, V = 2, 7, 5, 11
    hidden_BTH = (2 * torch.randn(B, T, H)).requires_grad_(True)
    weight_VH = torch.randn(V, H).requires_grad_(True)
    tokens_BT = torch.randint(0, V, (B, T))
    weights_BT = torch.randn(B, T)

    actual_BT = token_logprobs_from_hidden(hidden_BTH, weight_VH, tokens_BT, chunk_size=chunk_size)
    actual_grads = torch.autograd.grad((weights_BT * actual_BT).sum(), (hidden_BTH, weight_VH))
    reference_BT = _reference_logprobs(hidden_BTH.double() @ weight_VH.double().T, tokens_BT)
    reference_grads = torch.autograd.grad((weights_BT.double() * reference_BT).sum(), (hidden_BTH, weight_VH))

    assert actual_BT.dtype == torch.float32
    assert torch.allclose(actual_BT.double(), reference_BT, rtol=0, atol=1e-5)
    for actual, reference in zip(actual_grads, reference_grads):
        assert torch.allclose(actual.double(), reference.double(), rtol=0, atol=1e-4)


def test_token_logprobs_float64_and_bfloat16():
    """fp64 inputs stay fp64 (gradcheck); bf16 inputs are upcast: the head's matmul and its
    log-softmax run in fp32 (bf16 logits of ~30 would be off by up to 0.1 nats)."""
    torch.manual_seed(6)
    hidden_BTH = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    weight_VH = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    tokens_BT = torch.randint(0, 4, (2, 5))
    reference_BT = _reference_logprobs(hidden_BTH @ weight_VH.T, tokens_BT)
    assert torch.allclose(token_logprobs_from_hidden(hidden_BTH, weight_VH, tokens_BT, 2), reference_BT, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs_from_hidden(h, w, tokens_BT, 2), (hidden_BTH, weight_VH))
    low_BTH, low_VH = hidden_BTH.detach().bfloat16(), weight_VH.detach().bfloat16()
    actual_BT = token_logprobs_from_hidden(low_BTH, low_VH, tokens_BT, 3)
    assert actual_BT.dtype == torch.float32
    assert torch.allclose(actual_BT.double(), _reference_logprobs(low_BTH.double() @ low_VH.double().T, tokens_BT),
                          rtol=0, atol=1e-5)


def test_token_logprobs_from_hidden_match_model_logits(tiny_llama):
    """Hidden states @ lm_head, chunked and checkpointed, equal the model's own logits path
    in value and in the gradient reaching the parameters."""
    ids_BT = torch.tensor([[4, 8, 15, 16, 23, 42, 1], [2, 7, 1, 8, 28, 18, 28]])
    tokens_BT = ids_BT[:, 1:]
    weights_BT = torch.randn(2, 6, generator=torch.Generator().manual_seed(7))

    tiny_llama.zero_grad()
    via_logits_BT = token_logprobs(tiny_llama(input_ids=ids_BT).logits[:, :-1], tokens_BT)
    (weights_BT * via_logits_BT).sum().backward()
    grads_logits = {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}

    tiny_llama.zero_grad()
    hidden_BTH = tiny_llama.model(input_ids=ids_BT).last_hidden_state[:, :-1]
    via_hidden_BT = token_logprobs_from_hidden(hidden_BTH, tiny_llama.lm_head.weight, tokens_BT, chunk_size=4)
    (weights_BT * via_hidden_BT).sum().backward()

    assert torch.allclose(via_hidden_BT, via_logits_BT, rtol=0, atol=1e-5)
    for name, parameter in tiny_llama.named_parameters():
        assert torch.allclose(parameter.grad, grads_logits[name], rtol=1e-4, atol=1e-6), name
    tiny_llama.zero_grad()


# ---- metrics ------------------------------------------------------------------------------


def test_metrics_by_hand():
    """Completion tokens (mask 1) only: teacher - student = [+1, -1, -0.5] (padding holds nan);
    trainer - sampler = [0, ln 3, -ln 2] with cap 2 -> ratios [1, 2 (clipped from 3), 0.5]."""
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    student_BT = torch.tensor([[9.0, -1.0, -2.0], [9.0, -1.0, 9.0]])
    teacher_BT = torch.tensor([[9.0, 0.0, -3.0], [9.0, -1.5, float("nan")]])
    sampler_BT = student_BT - torch.tensor([[5.0, 0.0, math.log(3.0)], [5.0, -math.log(2.0), 5.0]])
    rewards_B = torch.tensor([1.0, 0.0])
    advantage_BT = combined_advantage(teacher_BT, student_BT, mask_BT, rewards_B, torch.tensor([0, 0]), lambda_rl=1.0)

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
