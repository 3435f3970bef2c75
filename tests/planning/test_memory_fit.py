"""A config's memory plan per GPU against the peaks measured on an H200, and its refusals."""

from __future__ import annotations

import pytest

from selfopd.config import load_config
from selfopd.config.bundles import PlanSettings
from selfopd.planning.memory_fit import plan_inputs, plan_run
from selfopd.planning.memory_plan import GIB, model_shape
from tests.planning.test_memory_plan import QWEN3_1P7B

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


def config(*overrides: str) -> PlanSettings:
    """A config's planned sections as written (its 'auto' dtype not resolved for this CPU machine: the planner
    resolves it)."""
    return PlanSettings.of(load_config(None, ["model.dtype=bfloat16", "model.device=cuda", *overrides], resolve=False))


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
                           "rollout.prompts_per_step=64", "model.gradient_checkpointing=true", "engine.max_model_len=8192"),
                    capacity_gib=141, gpu_name="H200", prompt_tokens=256, shapes={"student": qwen3_1p7b})
    student = next(p for p in plan.processes if p.name == "student server")
    assert student.gpus == (1, 2)
    weights, kv = student.held[0].bytes, student.phases["serve"][0].bytes
    assert weights == qwen3_1p7b.params * 2 / 2
    # 64 requests of 4 samples in flight (the default rollout.samples_per_prompt), one server: 256 sequences
    assert kv == 256 * (256 + 4096) * 28 * 2 * 4 * 128 * 2  # 8 KV heads, 4 a GPU
    assert student.budget == pytest.approx(0.9 * 141 * GIB)  # alone on its GPU, engine.gpu_memory_utilization = 0
    assert plan.refusal() is None


def test_a_server_over_its_share_is_refused_with_the_concurrency_that_fits(qwen3_1p7b):
    plan = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                           "engine.max_concurrency=1024", "rollout.max_tokens=8192", "engine.gpu_memory_utilization=0.5",
                           "rollout.prompts_per_step=256", "engine.max_model_len=9000"),
                    capacity_gib=80, gpu_name="H100", shapes={"student": qwen3_1p7b})
    refusal = plan.refusal()
    assert refusal is not None and "\n" not in refusal
    assert "the student server on GPU 1 (H100) needs" in refusal and "engine.gpu_memory_utilization = 0.5" in refusal
    fit = int(refusal.split("engine.max_concurrency to ")[1].split()[0])
    fitted = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                             f"engine.max_concurrency={fit}", "rollout.max_tokens=8192",
                             "engine.gpu_memory_utilization=0.5", "rollout.prompts_per_step=256",
                             "engine.max_model_len=9000"),
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


def test_auto_dtype_is_the_runs_rule_bf16_on_a_gpu_fp32_on_a_cpu_and_with_lora_on_vllm(qwen3_1p7b):
    def planned_dtype(settings: PlanSettings, on_gpu: bool) -> str:
        return plan_inputs(settings, on_gpu, 1, 256, {"student": qwen3_1p7b}).dtype

    auto = ("model.dtype=auto", "model.device=auto")
    assert planned_dtype(config(*auto), True) == "bfloat16" and planned_dtype(config(*auto), False) == "float32"
    assert planned_dtype(config("model.dtype=float32"), True) == "float32"
    assert planned_dtype(config(*auto, "model.lora_rank=8", "engine.kind=vllm"), True) == "float32"


def test_a_cpu_trainer_is_not_checked_against_a_gpu(qwen3_1p7b):
    plan = plan_run(PlanSettings.of(load_config(None, ["model.device=cpu"])), capacity_gib=1, shapes={"student": qwen3_1p7b})
    assert plan.refusal() is None and plan.processes[0].gpus == ()
    assert "CPU memory" in plan.table()


def test_the_teacher_servers_prompt_logprobs_come_beyond_its_share_and_each_fix_fits(qwen3_1p7b):
    """A teacher server alone on an 80 GiB GPU takes 0.9 of it (the KV cache fills its share); scoring 8,448-token
    rows forms a step's 8,192 positions of 151,936-entry logits (bf16) and two fp32 copies on top: 11.6 GiB."""
    overrides = ("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2", "rollout.max_tokens=8192",
                 "engine.max_model_len=9000", "model.gradient_checkpointing=true")
    plan = plan_run(config(*overrides), capacity_gib=80, gpu_name="H100", shapes={"student": qwen3_1p7b})
    teacher = next(p for p in plan.processes if p.name == "teacher server")
    assert [part.what for part in teacher.outside] == ["prompt_logprobs"]
    assert teacher.outside[0].bytes == 8192 * 151936 * (2 + 4 + 4)
    assert plan.need([teacher]) == pytest.approx(0.9 * 80 * GIB + 1.1 * teacher.outside[0].bytes + GIB)
    refusal = plan.refusal()
    assert refusal.startswith("the memory plan does not fit: GPU 2 (H100, 80.0 GiB) needs 85.8 GiB for the teacher "
                              "server; the teacher server's prompt_logprobs (11.6 GiB) come on top of the share vLLM "
                              "takes; fits with: engine.gpu_memory_utilization=")
    share = refusal.split("engine.gpu_memory_utilization=")[1].split()[0]
    tokens = refusal.split("--max-num-batched-tokens ")[1].split("'")[0]
    for fix in (f"engine.gpu_memory_utilization={share}", f"engine.extra_server_args=--max-num-batched-tokens {tokens}"):
        assert plan_run(config(*overrides, fix), capacity_gib=80, gpu_name="H100",
                        shapes={"student": qwen3_1p7b}).refusal() is None, fix


def test_the_in_run_eval_counts_on_the_student_servers_and_its_batch_is_what_fits(qwen3_1p7b):
    """AIME avg@16 at 32,768 tokens on 4 student servers: 32 prompts of 16 samples, 8 prompts a server."""
    overrides = ("engine.kind=vllm", "engine.student_servers=4", "engine.student_gpus=4,5,6,7",
                 "engine.teacher_engine=local", "engine.max_model_len=36864", "eval.max_tokens=32768",
                 "eval.samples=16", "eval.temperature=0.6", "eval.batch_size=32", "model.gradient_checkpointing=true")
    plan = plan_run(config(*overrides), capacity_gib=141, gpu_name="H200", shapes={"student": qwen3_1p7b}, world=4)
    server = next(p for p in plan.processes if p.name == "student-0 server")
    assert server.peak_phase == "eval"
    assert server.phases["eval"][0].bytes == 8 * 16 * (256 + 32768) * 28 * 2 * 8 * 128 * 2
    refusal = plan.refusal()
    assert "the student-0 server on GPU 4 (H200) needs" in refusal and "in-run eval sequences" in refusal
    fit = int(refusal.split("lower eval.batch_size to ")[1].split()[0])
    fitted = plan_run(config(*overrides, f"eval.batch_size={fit}"), capacity_gib=141, gpu_name="H200",
                      shapes={"student": qwen3_1p7b}, world=4)
    assert "eval" not in (fitted.refusal() or "")


def test_max_model_len_must_hold_the_longest_sequence_the_servers_serve(qwen3_1p7b):
    plan = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                           "engine.max_model_len=2048", "eval.max_tokens=4096"),
                    capacity_gib=None, on_gpu=True, shapes={"student": qwen3_1p7b})
    assert plan.refusal() == ("engine.max_model_len = 2048 cannot hold a prompt of 256 tokens (assumed: selfopd plan "
                              "--prompt-tokens) + eval.max_tokens (4096) + 1 on the launched servers; raise it to 4353 "
                              "or more")


def test_an_in_process_eval_is_a_phase_of_the_trainer(qwen3_1p7b):
    plan = plan_run(config("eval.max_tokens=8192", "eval.batch_size=16", "eval.samples=4", "eval.temperature=1",
                           "engine.batch_size=48"), capacity_gib=None, on_gpu=True, shapes={"student": qwen3_1p7b})
    (part,) = plan.processes[0].phases["eval"]
    assert part.bytes == 48 * (256 + 8192) * 28 * 2 * 8 * 128 * 2  # engine.batch_size rows of the 64 at a time


def test_trainer_gpus_are_suggested_only_where_no_server_runs(qwen3_1p7b):
    """OPSD's layout: 4 trainer ranks on GPUs 0-3, student servers on GPUs 4-7: never 8 GPUs for the trainer."""
    def tried(plan):
        return [what for what, _ in plan.suggest(plan.inputs)]

    servers = ("engine.kind=vllm", "engine.student_servers=4", "engine.student_gpus=4,5,6,7",
               "engine.teacher_engine=local", "rollout.max_tokens=4096", "engine.max_model_len=8192")
    opsd = plan_run(config(*servers), capacity_gib=30, gpu_name="H100", shapes={"student": qwen3_1p7b}, world=4)
    assert "model.gradient_checkpointing=true" in tried(opsd) and not any("torchrun" in what for what in tried(opsd))
    assert opsd.refusal().startswith("the memory plan does not fit: GPU 0 ") and "torchrun" not in opsd.refusal()
    split = plan_run(config("engine.kind=vllm", "engine.student_gpus=1", "engine.teacher_gpus=2",
                            "rollout.max_tokens=1024"), capacity_gib=30, gpu_name="H100", shapes={"student": qwen3_1p7b})
    assert not any("torchrun" in what for what in tried(split))  # GPUs 1 and 2 hold servers: no FSDP over 0-1 or 0-3
    alone = plan_run(config("rollout.max_tokens=1024"), capacity_gib=30, gpu_name="H100",
                     shapes={"student": qwen3_1p7b}, gpu_count=4)
    assert [what for what in tried(alone) if "torchrun" in what] == [
        "GPUs 0-1 for the trainer (torchrun --nproc-per-node 2, FSDP)",
        "GPUs 0-3 for the trainer (torchrun --nproc-per-node 4, FSDP)"]  # the machine has 4
