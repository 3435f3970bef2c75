"""torch.compile where selfopd uses it: the decoder layers of a trained student (model.compile_layers).
The compiled decode step (engine.compiled_sampling) is tested with the in-process engine (test_local.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfopd.config import load_config
from selfopd.engines.compiled import compile_decoder_layers, compiled_width
from selfopd.training.trainer import build_run, train_step

pytestmark = pytest.mark.slow

STEPS = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=8",
    "optim.micro_batch_prompts=1", "optim.lr=1e-3", "run.progress=false", "run.eval_every=0",
    "loss.divergence=reverse_kl", "teacher.kind=frozen",  # the teacher sees the answer: a loss that is not 0
]


def _steps(tmp_path: Path, model: Path, name: str, *extra: str) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """The metrics of two train steps, and the weights (flattened) before and after them."""
    run = build_run(load_config(None, [*STEPS, f"model.student={model}", f"run.out_dir={tmp_path}",
                                       f"run.name={name}", *extra]))
    run.run_dir.mkdir(parents=True)
    flat = lambda: torch.cat([p.detach().flatten() for p in run.model.parameters()])  # noqa: E731
    try:
        before = flat()
        metrics = [train_step(run) for _ in range(2)]
        return metrics, before, flat()
    finally:
        run.close()


@pytest.mark.parametrize("family,extra", [("llama", ()), ("qwen3_5", ()),
                                          ("llama", ("model.dtype=bfloat16", "model.gradient_checkpointing=true"))],
                         ids=["llama", "qwen3_5", "llama-bf16-checkpointing"])
def test_compiled_layers_train_what_eager_layers_train(tmp_path, tiny_family_dirs, family, extra):
    """Two train steps (the student samples through its layers, scores, trains a full-vocabulary loss):
    with every decoder layer compiled, the same rollouts, the same loss and the same weights up to
    fp32 summation order. (About a minute a case: each compiles its layers' forward and backward; Qwen3.5's
    Gated DeltaNet two.)"""
    from torch._dynamo.utils import counters

    folder = tiny_family_dirs[family]
    eager, start, eager_end = _steps(tmp_path, folder, "eager", *extra)
    torch._dynamo.reset()
    compiled, _, compiled_end = _steps(tmp_path, folder, "compiled", "model.compile_layers=true", *extra)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers were compiled
    close = {"rtol": 1e-2, "atol": 1e-2} if "model.dtype=bfloat16" in extra else {"rtol": 1e-3, "atol": 1e-6}
    for a, b in zip(eager, compiled):
        assert a["rollout/length_mean"] == b["rollout/length_mean"]
        torch.testing.assert_close(b["loss/pg"], a["loss/pg"], **close)
        torch.testing.assert_close(b["optim/grad_norm"], a["optim/grad_norm"], **close)
    # AdamW moves a weight by about lr a step whatever its gradient's size (a gradient near 0 too, where
    # summation order decides its sign), so the runs' weights are compared as updates: the two runs'
    # weights differ by a small part of how far the steps moved them.
    apart = torch.linalg.vector_norm(compiled_end - eager_end) / torch.linalg.vector_norm(eager_end - start)
    assert apart < (0.2 if "model.dtype=bfloat16" in extra else 0.05)
    assert not torch.equal(compiled_end, eager_end)  # compiled code ran


def test_every_decoder_layer_is_compiled_and_a_model_without_them_compiles_nothing(tiny_family_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family_dirs["qwen3_5_conditional"])  # a vision-language layout
    assert compile_decoder_layers(model) == model.config.get_text_config().num_hidden_layers
    assert compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0
    assert [compiled_width(n) for n in (1, 64, 65)] == [64, 64, 128]
