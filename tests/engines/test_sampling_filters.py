"""The in-process sampler's min-p / top-k / top-p filters (`selfopd.engines.local.SampledPolicy`)
against an independent float64 computation of the filtered distribution, and its draws against
that distribution's frequencies; on a tiny model, top_k = 1 samples the greedy answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine, SampledPolicy


def reference_logprobs(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """The filtered, renormalised distribution in float64, in vLLM's order: temperature, min-p
    (below min_p x the top probability), top-k (ties at the k-th value kept), top-p (the smallest
    set of the most likely tokens whose mass reaches top_p)."""
    z = logits.astype(np.float64) / temperature
    keep = np.ones_like(z, dtype=bool)
    p = np.exp(z - z.max()); p /= p.sum()
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        keep &= z >= np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1:
        q = np.where(keep, p, 0.0); q /= q.sum()
        order = np.argsort(-q, kind="stable")
        mass_before = np.cumsum(q[order]) - q[order]  # a token is kept while the mass before it is < top_p
        nucleus = np.zeros_like(keep)
        nucleus[order[mass_before < top_p]] = True
        keep &= nucleus
    out = np.full_like(z, -np.inf)
    out[keep] = z[keep] - np.log(np.exp(z[keep] - z[keep].max()).sum()) - z[keep].max()
    return out


CASES = [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.0, 1.0, 5, 0.0), (1.3, 1.0, 0, 0.1), (0.8, 0.8, 12, 0.02),
         (1.0, 0.95, 20, 0.05), (2.0, 0.5, 3, 0.3)]


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", CASES)
def test_filtered_distribution_equals_a_float64_reference(temperature, top_p, top_k, min_p):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 64, generator=generator) * 3
    policy = SampledPolicy(temperature, top_p, top_k, min_p)
    got = policy.logprobs(torch.zeros(6, 1, dtype=torch.long), logits).double().numpy()
    for row in range(6):
        want = reference_logprobs(logits[row].numpy(), temperature, top_p, top_k, min_p)
        assert np.array_equal(np.isinf(got[row]), np.isinf(want)), (row, np.isinf(got[row]).sum(), np.isinf(want).sum())
        finite = np.isfinite(want)
        assert np.allclose(got[row][finite], want[finite], atol=1e-5)


def test_draws_follow_the_filtered_distribution():
    """20,000 draws of one row of a 12-token vocabulary: every frequency within 5 standard errors
    of the reference probability, and no token outside the filters ever drawn."""
    logits = torch.tensor([[2.0, 1.8, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -4.0]])
    temperature, top_p, top_k, min_p = 1.2, 0.9, 6, 0.05
    want = np.exp(reference_logprobs(logits[0].numpy(), temperature, top_p, top_k, min_p))
    policy = SampledPolicy(temperature, top_p, top_k, min_p)
    torch.manual_seed(0)
    draws = 20_000
    tokens = [int(policy(torch.zeros(1, 1, dtype=torch.long), logits).argmax()) for _ in range(draws)]
    counts = np.bincount(tokens, minlength=12) / draws
    assert counts[want == 0].sum() == 0
    assert np.all(np.abs(counts - want) <= 5 * np.sqrt(want * (1 - want) / draws) + 1e-12), (counts, want)


def test_greedy_ignores_the_filters_and_defaults_filter_nothing():
    logits = torch.randn(3, 40)
    assert SampledPolicy(0.0, 0.5, 3, 0.2).filters == [] and SampledPolicy(1.0, 1.0).filters == []
    assert torch.equal(SampledPolicy(1.0, 1.0, 0, 0.0).logprobs(None, logits), logits.log_softmax(-1))


def test_sampling_params_refuse_bad_filters():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_top_k_1_samples_the_greedy_answer_in_process(tiny_model_dir, smollm2_tokenizer):
    """top_k = 1 leaves one token: at temperature 1 the engine samples exactly the greedy ids,
    each with logprob 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = LocalEngine(model, smollm2_tokenizer, batch_size=4)
    prompts = [[1, 5, 9, 3], [2, 7]]
    greedy = engine.sample(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    topk = engine.sample(prompts, SamplingParams(max_tokens=6, temperature=1.0, top_k=1, n=2, seed=3))
    for [g], group in zip(greedy, topk):
        for rollout in group:
            assert rollout.completion_ids == g.completion_ids
            assert max(abs(x) for x in rollout.sampler_logprobs) < 1e-6
