"""What the per-step speed-ups change and what they leave bit for bit: the teacher states kept
for a full-vocabulary loss give the engine's own scores exactly; the fused AdamW rounds
differently from torch's for-loop AdamW, within a stated tolerance; the probe skips only
engines over the very module it would compare them with."""

from __future__ import annotations

import pytest
import torch

from selfopd.config import load_config
from selfopd.engines.build import load_model
from selfopd.engines.local import LocalEngine
from selfopd.training.setup import adamw
from selfopd.training.teacher import score_in_micro_batches, score_step

PAIRS = [([1, 5, 9, 4, 7], [8, 2, 11, 40]), ([1, 6], [9, 9, 30]), ([1, 5, 9, 4, 7], [8, 3]),
         ([3, 4, 5], [6, 7, 8, 9, 10])]
# |fused - for-loop| / |update| of the weights after 5 AdamW steps: measured up to 4.8e-7 at lr 1e-3
# (0.2-1% of the weights round differently), 0 at lr 1e-6.
FUSED_TOLERANCE = 5e-6


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_teacher_states_give_the_engines_scores_bit_for_bit(tiny_model_dir, precision, temperature):
    model, tokenizer = load_model(tiny_model_dir)
    engine = LocalEngine(model, tokenizer, batch_size=8, precision=precision)
    scores, states = score_in_micro_batches(engine, PAIRS, per_micro=2, top_k=0, temperature=temperature,
                                            keep_states=True)
    direct = [s for start in (0, 2) for s in engine.score(PAIRS[start : start + 2], temperature=temperature)]
    assert len(states) == 2 and states[0][0].shape[:2] == (2, 4)
    for kept, scored in zip(scores, direct):
        assert torch.equal(kept.logprobs, scored.logprobs)
    plain, none = score_in_micro_batches(engine, PAIRS, per_micro=2, top_k=0, temperature=temperature,
                                         keep_states=False)
    assert none == [] and all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(plain, direct))


def test_an_engine_that_batches_itself_gets_the_whole_step_once_each_distinct_sequence(tiny_model_dir):
    """vLLM (`batches_itself`): the step's teacher rows and its baseline rows in one call, each
    distinct sequence scored once and shared by the rows that repeat it (an identical baseline row
    then gives exactly its teacher row's numbers: the empty-context control is exactly zero)."""
    model, tokenizer = load_model(tiny_model_dir)

    class Batching(LocalEngine):
        batches_itself = True
        calls: list = []

        def score(self, sequences, top_k=0, temperature=1.0):
            self.calls.append(list(sequences))
            return super().score(sequences, top_k=top_k, temperature=temperature)

    engine = Batching(model, tokenizer, batch_size=8)
    baseline = [PAIRS[0], ([1, 2], [8, 2, 11, 40]), PAIRS[2], PAIRS[3]]  # rows 0, 2, 3 equal their teacher rows
    scores, states, baseline_scores = score_step(engine, PAIRS, baseline, per_micro=2, top_k=0, temperature=1.0,
                                                 keep_states=False)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 5  # 8 rows, 5 distinct sequences, one call
    assert states == [] and len(scores) == len(baseline_scores) == 4
    for row in (0, 2, 3):
        assert torch.equal(scores[row].logprobs, baseline_scores[row].logprobs)
    alone = LocalEngine(model, tokenizer, batch_size=8).score([baseline[1]])[0].logprobs
    assert torch.allclose(baseline_scores[1].logprobs, alone, atol=1e-5)


@pytest.mark.parametrize("lr", [1e-3, 1e-6])
def test_fused_adamw_rounds_within_tolerance_of_the_for_loop_one(lr):
    config = load_config(None, [f"optim.lr={lr}", "optim.weight_decay=0.01"])
    torch.manual_seed(0)
    start = [torch.randn(257, 33), torch.randn(1000), torch.randn(3, 5, 7)]
    grads = [[torch.randn_like(p) * 10.0 ** -k for p in start] for k in range(5)]
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = adamw(params, config) if fused else torch.optim.AdamW(
            params, lr=lr, betas=(config.optim.beta1, config.optim.beta2), weight_decay=0.01)
        assert bool(optimizer.defaults["fused"]) == fused
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
        results.append([p.detach() for p in params])
    for fused, loop, begin in zip(*results, start):
        moved = (loop - begin).abs().max()
        assert moved > 0
        assert ((fused - loop).norm() / (loop - begin).norm()).item() < FUSED_TOLERANCE


def test_the_exponential_race_draws_exactly_the_tempered_nucleus():
    """SampledPolicy draws argmax(log p - log E), E ~ Exp(1): the frequencies of 40000 draws
    match softmax(logits / T) restricted to the top-p nucleus (chi-square, seeded), tokens
    outside the nucleus are never drawn, and the kept logprob is the drawn token's under that
    distribution. Greedy is the argmax of the raw logits."""
    from scipy.stats import chisquare

    from selfopd.engines.local import SampledPolicy

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 40_000
    torch.manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.8)):
        policy = SampledPolicy(temperature, top_p)
        chosen = policy(torch.zeros(rows, 1, dtype=torch.long), logits.repeat(rows, 1))
        tokens = chosen.argmax(-1)
        assert torch.all(chosen.max(-1).values == 0) and torch.all(torch.isinf(chosen).sum(-1) == len(logits) - 1)
        probs = (logits / temperature).softmax(-1).double()
        if top_p < 1:  # the smallest set of most likely tokens whose mass reaches top_p
            order = probs.argsort(descending=True)
            keep = order[: int((probs[order].cumsum(0) < top_p).sum()) + 1]
            nucleus = torch.zeros_like(probs).index_fill_(0, keep, 1.0)
            probs = probs * nucleus / (probs * nucleus).sum()
        counts = torch.bincount(tokens, minlength=len(logits)).double()
        assert torch.all(counts[probs == 0] == 0)
        seen = probs > 0
        expected = probs[seen] / probs[seen].sum() * counts.sum()
        assert chisquare(counts[seen].numpy(), expected.numpy()).pvalue > 1e-3, (temperature, top_p)
        expected_lp = probs.log()[tokens]
        assert torch.allclose(policy.drawn_logprobs(1, rows)[:, 0].double(), expected_lp, atol=1e-5)
    greedy = SampledPolicy(0.0, 1.0)
    assert greedy(torch.zeros(3, 1, dtype=torch.long), logits.repeat(3, 1)).argmax(-1).tolist() == [0, 0, 0]
