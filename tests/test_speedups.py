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
from selfopd.run_setup import adamw
from selfopd.teacher_scoring import score_in_micro_batches

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
