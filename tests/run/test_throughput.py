"""Throughput figures (`selfopd.run.throughput`): the FLOP estimate against torch's own FLOP counter, the
per-phase rates and MFU by hand, a step's lines on the CPU, and a run's hours from its metrics."""

from __future__ import annotations

import json

import pytest
import torch

from selfopd.run.throughput import (StepTokens, model_flops_per_token, peak_flops, run_gpus, run_hours,
                                    throughput_metrics)


@pytest.mark.parametrize("tied", [True, False])
def test_the_flop_estimate_matches_torch_s_flop_counter_on_a_forward_and_backward(tied):
    """6 FLOPs per matrix parameter per token plus 12 x layers x width x length for attention, against
    `torch.utils.flop_counter` counting every matmul and attention kernel of a real forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tied,
                         attn_implementation="eager")  # sdpa's CPU kernel is not counted by torch
    model = LlamaForCausalLM(config)
    batch, length = 2, 256
    ids = torch.randint(0, config.vocab_size, (batch, length))
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids, labels=ids).loss.backward()
    estimate = model_flops_per_token(model, length) * batch * length
    assert estimate == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_rates_and_mfu_are_the_tokens_over_each_phase_s_seconds():
    tokens = StepTokens(sampled=600, scored=800, trained=2000)
    seconds = {"time/sample": 3.0, "time/teacher": 4.0, "time/train": 5.0, "time/step": 15.0}
    metrics = throughput_metrics(tokens, seconds, flops_per_token=1e9, peak=1e12, devices=2, gpus=3)
    assert metrics == {"throughput/sampled_tokens_per_s": 200.0, "throughput/scored_tokens_per_s": 200.0,
                       "throughput/trained_tokens_per_s": 400.0, "throughput/tokens_per_s": 40.0,
                       "throughput/mfu": pytest.approx(1e9 * 2000 / (5.0 * 1e12 * 2)), "throughput/gpus": 3.0}
    bare = throughput_metrics(tokens, {"time/step": 2.0, "time/train": 1.0})  # no teacher phase, a CPU
    assert bare == {"throughput/trained_tokens_per_s": 2000.0, "throughput/tokens_per_s": 300.0}


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989.4e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None


def test_the_gpus_a_run_holds():
    from selfopd.config import load_config

    engine = load_config(None, ["engine.kind=vllm", "engine.student_servers=2", "engine.student_gpus=1,2",
                                "engine.teacher_gpus=3"]).engine
    assert run_gpus(engine, trainer_devices=1, trainer_on_gpu=True) == 4
    assert run_gpus(engine, trainer_devices=1, trainer_on_gpu=False) == 3
    assert run_gpus(load_config(None).engine, trainer_devices=2, trainer_on_gpu=False) == 0


def test_a_run_s_hours_add_its_steps(tmp_path):
    lines = [{"step": 1, "time/step": 1800.0, "throughput/gpus": 4.0}, {"step": 1, "eval/accuracy": 0.5},
             {"step": 2, "time/step": 1800.0, "throughput/gpus": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"step": 3, "time/st')  # being written
    assert run_hours(tmp_path) == {"train_hours": 1.0, "gpu_hours": 4.0}
    assert run_hours(tmp_path / "missing") == {"train_hours": 0.0, "gpu_hours": 0.0}


def test_a_cpu_step_reports_its_rates_and_no_gpu_figures(tmp_path, tiny_model_dir):
    from selfopd.config import load_config
    from selfopd.training.trainer import build_run, train_step

    config = load_config(None, [f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=rates",
                                "run.progress=false", "run.eval_every=0", "rollout.prompts_per_step=2",
                                "rollout.samples_per_prompt=2", "rollout.max_tokens=8", "optim.micro_batch_prompts=1",
                                "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=2", "data.eval_size=4"])
    run = build_run(config)
    try:
        metrics = train_step(run)
    finally:
        run.close()
    assert metrics["throughput/tokens_per_s"] * metrics["time/step"] == pytest.approx(metrics["tokens/completion"])
    assert metrics["throughput/trained_tokens_per_s"] > metrics["throughput/tokens_per_s"] > 0
    assert "throughput/scored_tokens_per_s" in metrics  # the self-teacher scored the completions
    assert not {"throughput/mfu", "memory/peak_gb", "throughput/gpus"} & set(metrics)
