"""A config's memory plan per GPU against the peaks measured on an H200, and its refusals."""

from __future__ import annotations

import pytest

from selfopd.config import load_config
from selfopd.engines.memory_fit import plan_run, resolved_dtype
from selfopd.engines.memory_plan import GIB, model_shape
from tests.engines.test_memory_plan import QWEN3_1P7B

# torch.cuda.max_memory_allocated of the trainer (one H200, bf16 autocast over fp32 master weights, in-process
# engine, `self` teacher), 2026-12-04: gpu_check_h200.json (8 prompts x 4 samples x 128 tokens) and
# gpu_scale_h200.json (16 x 4 x 512), both with 4 prompts a micro-batch; the prompts ~40 tokens.
H200_PEAKS_GIB = [
    ((8, 4, 128), (), 42.822),
    ((8, 4, 128), ("model.gradient_checkpointing=true",), 29.888),
    ((8, 4, 128), ("model.lora_rank=16",), 13.182),
    ((8, 4, 128), ("model.lora_rank=16", "model.gradient_checkpointing=true"), 6.259),
    ((16, 4, 512), (), 67.588),
    ((16, 4, 512), ("loss.divergence=jsd",), 73.095),
    ((16, 4, 512), ("model.gradient_checkpointing=true", "loss.divergence=jsd"), 39.25),
]


@pytest.fixture(scope="module")
def qwen3_1p7b():
    from transformers import Qwen3Config

    return model_shape(Qwen3Config(**QWEN3_1P7B), "Qwen3-1.7B")


def config(*overrides: str):
    """A config as written (its 'auto' dtype not resolved for this CPU machine: the planner resolves it)."""
    return load_config(None, ["model.dtype=bfloat16", "model.device=cuda", *overrides], resolve=False)


@pytest.mark.parametrize("shape,overrides,measured", H200_PEAKS_GIB)
def test_trainer_peak_is_within_ten_percent_of_the_h200s(qwen3_1p7b, shape, overrides, measured):
    prompts, samples, tokens = shape
    plan = plan_run(config(f"rollout.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
                           f"rollout.max_tokens={tokens}", "optim.micro_batch_prompts=4", *overrides),
                    capacity_gib=139.8, gpu_name="NVIDIA H200", prompt_tokens=40, shapes={"student": qwen3_1p7b})
    assert plan.processes[0].peak / GIB == pytest.approx(measured, rel=0.10)
    assert plan.refusal() is None  # and the check's headroom covers the measured peak
    assert plan.need(plan.processes) / GIB >= measured


def test_a_plan_that_does_not_fit_is_refused_in_one_line_with_what_fits(qwen3_1p7b):
    plan = plan_run(config("rollout.prompts_per_step=16", "rollout.max_tokens=1024", "optim.micro_batch_prompts=8"),
                    capacity_gib=80, gpu_name="H100", prompt_tokens=256, shapes={"student": qwen3_1p7b})
    refusal = plan.refusal()
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("the memory plan does not fit: GPU 0 (H100, 80.0 GiB) needs ")
    assert "fits with: " in refusal and "model.gradient_checkpointing=true" in refusal
    assert "DOES NOT FIT" in plan.table()


def test_servers_get_weights_and_kv_cache_per_tensor_parallel_gpu(qwen3_1p7b):
    plan = plan_run(config("engine.kind=vllm", "engine.student_gpus=1,2", "engine.tensor_parallel_size=2",
                           "engine.teacher_gpus=3,4", "engine.max_concurrency=256", "rollout.max_tokens=4096",
                           "model.gradient_checkpointing=true"),
                    capacity_gib=80, gpu_name="H100", prompt_tokens=256, shapes={"student": qwen3_1p7b})
    student = next(p for p in plan.processes if p.name == "student server")
    assert student.gpus == (1, 2)
    weights, kv = student.held[0].bytes, student.phases["serve"][0].bytes
    assert weights == qwen3_1p7b.params * 2 / 2
    assert kv == 256 * (256 + 4096) * 28 * 2 * 4 * 128 * 2  # 8 KV heads, 4 a GPU
    assert student.budget == pytest.approx(0.9 * 80 * GIB)  # alone on its GPU, engine.gpu_memory_utilization = 0
    assert plan.refusal() is None


def test_a_server_over_its_share_is_refused_with_the_concurrency_that_fits(qwen3_1p7b):
    plan = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                           "engine.max_concurrency=1024", "rollout.max_tokens=8192", "engine.gpu_memory_utilization=0.5"),
                    capacity_gib=80, gpu_name="H100", shapes={"student": qwen3_1p7b})
    refusal = plan.refusal()
    assert refusal is not None and "\n" not in refusal
    assert "the student server on GPU 1 (H100) needs" in refusal and "engine.gpu_memory_utilization = 0.5" in refusal
    fit = int(refusal.split("engine.max_concurrency to ")[1].split()[0])
    fitted = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                             f"engine.max_concurrency={fit}", "rollout.max_tokens=8192",
                             "engine.gpu_memory_utilization=0.5"),
                      capacity_gib=80, gpu_name="H100", shapes={"student": qwen3_1p7b})
    assert "student server" not in (fitted.refusal() or "")


def test_lora_and_fsdp_shrink_what_a_rank_holds(qwen3_1p7b):
    full = plan_run(config(), capacity_gib=None, shapes={"student": qwen3_1p7b}, on_gpu=True)
    fsdp = plan_run(config(), capacity_gib=None, shapes={"student": qwen3_1p7b}, on_gpu=True, world=4)
    lora = plan_run(config("model.lora_rank=16"), capacity_gib=None, shapes={"student": qwen3_1p7b}, on_gpu=True)
    held = {name: sum(p.bytes for p in plan.processes[0].held) for name, plan in
            (("full", full), ("fsdp", fsdp), ("lora", lora))}
    assert held["fsdp"] == pytest.approx(held["full"] / 4)
    assert held["lora"] == pytest.approx(qwen3_1p7b.params * 2 + 17_432_576 * 12)
    assert [p.gpus for p in fsdp.processes] == [(0,), (1,), (2,), (3,)]


def test_a_frozen_teacher_in_process_is_a_second_fp32_copy(qwen3_1p7b):
    plan = plan_run(config("teacher.kind=frozen"), capacity_gib=None, on_gpu=True, shapes={"student": qwen3_1p7b})
    teacher = next(p for p in plan.processes[0].held if p.what == "teacher weights")
    assert teacher.bytes == qwen3_1p7b.params * 4
    with_lora = plan_run(config("teacher.kind=frozen", "model.lora_rank=8"), capacity_gib=None, on_gpu=True,
                         shapes={"student": qwen3_1p7b})
    assert all(p.what != "teacher weights" for p in with_lora.processes[0].held)  # the base, adapters off


def test_auto_dtype_is_the_runs_rule_bf16_on_a_gpu_fp32_on_a_cpu_and_with_lora_on_vllm():
    auto = ("model.dtype=auto", "model.device=auto")
    assert resolved_dtype(config(*auto), True) == "bfloat16" and resolved_dtype(config(*auto), False) == "float32"
    assert resolved_dtype(config("model.dtype=float32"), True) == "float32"
    assert resolved_dtype(config(*auto, "model.lora_rank=8", "engine.kind=vllm"), True) == "float32"


def test_a_cpu_trainer_is_not_checked_against_a_gpu(qwen3_1p7b):
    plan = plan_run(load_config(None, ["model.device=cpu"]), capacity_gib=1, shapes={"student": qwen3_1p7b})
    assert plan.refusal() is None and plan.processes[0].gpus == ()
    assert "CPU memory" in plan.table()
