"""selfopd.engines.kernels: the chunked logprobs of given tokens from hidden states and a head,
against float64 brute force, gradcheck and the model's own logits path."""

from __future__ import annotations

import pytest
import torch

from selfopd.engines.kernels import token_logprobs_from_hidden

torch.set_num_threads(1)


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token], plainly."""
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)


def _reference_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV.double(), dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)


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




@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_backward_forms_no_logits_again_for_the_last_window(chunk_size):
    """The last window's d values / d logits is formed in forward and kept: backward forms the
    logits only of the other windows (none when one window holds every position), and none is
    formed for a gradient under no_grad. The gradients are the recomputing path's bit for bit (a
    second backward through the retained graph recomputes every window)."""
    from selfopd.engines.kernels import chunked_on_real_positions

    torch.manual_seed(7)
    B, T, H, V = 2, 5, 4, 9
    hidden_BTH = torch.randn(B, T, H, requires_grad=True)
    weight_VH = torch.randn(V, H, requires_grad=True)
    mask_BT = torch.rand(B, T) > 0.3
    calls: list[bool] = []

    def entropy(lp_BWV: torch.Tensor, window: slice, mask_BW: torch.Tensor, need_grad: bool):
        calls.append(need_grad)
        p_BWV = lp_BWV.exp()
        values_BW = -(p_BWV * lp_BWV).sum(-1)
        return values_BW, (-p_BWV * (lp_BWV + values_BW[..., None]) if need_grad else None)

    windows = -(-int(mask_BT.sum()) // (chunk_size * B))
    with torch.no_grad():
        chunked_on_real_positions(hidden_BTH, weight_VH, mask_BT, entropy, chunk_size)
    assert calls == [False] * windows
    calls.clear()
    weights_BT = torch.randn(B, T)
    loss = (weights_BT * chunked_on_real_positions(hidden_BTH, weight_VH, mask_BT, entropy, chunk_size)).sum()
    first = torch.autograd.grad(loss, (hidden_BTH, weight_VH), retain_graph=True)
    assert calls == [False] * (windows - 1) + [True] + [True] * (windows - 1)  # forward, then backward
    again = torch.autograd.grad(loss, (hidden_BTH, weight_VH))
    assert len(calls) == 3 * windows - 1
    for kept, recomputed in zip(first, again):
        if windows == 1:
            assert torch.equal(kept, recomputed)
        else:  # the kept window's part of the head's gradient is added first: another order of an fp32 sum
            assert torch.allclose(kept, recomputed, rtol=1e-6, atol=1e-6)
    logprobs_BTV = torch.log_softmax(hidden_BTH.double() @ weight_VH.double().T, -1)
    reference_BT = torch.where(mask_BT, -(logprobs_BTV.exp() * logprobs_BTV).sum(-1), 0.0)
    reference = torch.autograd.grad((weights_BT.double() * reference_BT).sum(), (hidden_BTH, weight_VH))
    for actual, expected in zip(first, reference):
        assert torch.allclose(actual.double(), expected.double(), rtol=0, atol=1e-5)
    calls.clear()  # keep_last=False (another loss window follows before backward): every window formed again
    values_BT = chunked_on_real_positions(hidden_BTH, weight_VH, mask_BT, entropy, chunk_size, keep_last=False)
    recomputed = torch.autograd.grad((weights_BT * values_BT).sum(), (hidden_BTH, weight_VH))
    assert calls == [False] * windows + [True] * windows
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(first, recomputed))
