"""The 'auto' settings: pure functions of a stated machine (no GPU here), so the CUDA rules are
tested by saying there is one; on this CPU machine a loaded config computes what it always did."""

from __future__ import annotations

import dataclasses

import pytest

from selfopd.config import TrainConfig, load_config
from selfopd.config.auto import Machine, auto_choices, auto_dtype, resolve_auto

CPU, NODE = Machine(cuda=False), Machine(cuda=True, gpu_count=8)


def lines(config: TrainConfig, machine: Machine) -> list[str]:
    return [choice.line() for choice in auto_choices(config, machine)]


def test_the_default_dtype_is_auto_and_loads_as_float32_on_this_cpu_machine():
    assert TrainConfig().model.dtype == "auto"
    assert load_config(None).model.dtype == "float32"  # what every CPU run computed before 'auto'
    assert load_config(None, resolve=False).model.dtype == "auto"
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"  # an explicit value wins


@pytest.mark.parametrize("overrides, machine, dtype, why", [
    ([], CPU, "float32", "CPU device"),
    ([], NODE, "bfloat16", "CUDA device"),
    (["model.device=cuda:3"], NODE, "bfloat16", "CUDA device"),
    (["model.device=cpu"], NODE, "float32", "CPU device"),
    (["model.lora_rank=8", "engine.kind=vllm", "rollout.temperature=1"], NODE, "float32",
     "CUDA device, but LoRA with a vLLM engine is refused in bf16"),
    (["model.lora_rank=8"], NODE, "bfloat16", "CUDA device"),
])
def test_auto_dtype_by_machine_and_config(overrides, machine, dtype, why):
    config = load_config(None, overrides, resolve=False)
    choice = auto_dtype(config, machine)
    assert (choice.value, choice.why) == (dtype, why)
    resolved = resolve_auto(config, machine)
    assert resolved.model.dtype == dtype and resolve_auto(resolved, CPU) == resolved  # once, then fixed
    assert dataclasses.replace(resolved, model=config.model) == config  # nothing else changes


def test_choices_name_each_auto_setting_and_why():
    assert lines(load_config(None, resolve=False), NODE) == ["model.dtype = bfloat16 (auto: CUDA device)"]
    assert lines(load_config(None), NODE) == []  # resolved: nothing left to choose for the local engine
    node = load_config(None, ["engine.kind=vllm", "rollout.temperature=1", "engine.student_gpus=1",
                              "engine.teacher_gpus=2", "model.device=cuda:0"], resolve=False)
    chosen = lines(node, NODE)
    assert chosen[:3] == ["model.dtype = bfloat16 (auto: CUDA device)",
                          "engine.gpu_memory_utilization [student] = 0.9 (auto: server alone on GPU 1)",
                          "engine.gpu_memory_utilization [teacher] = 0.9 (auto: server alone on GPU 2)"]
    assert chosen[3].startswith("engine.request_timeout_s = 0 (auto: no fixed timeout: each request may take 300 s")
    assert lines(dataclasses.replace(node, engine=dataclasses.replace(node.engine, request_timeout_s=60.0,
                                                                      gpu_memory_utilization=0.5)), NODE) == \
        ["model.dtype = bfloat16 (auto: CUDA device)"]  # explicit values are not 'auto'
    assert lines(node, CPU)[1] == ("engine.gpu_memory_utilization = 0 (auto: no GPU: vLLM on a CPU uses "
                                   "engine.cpu_kv_cache_gb)")
    colocated = load_config(None, ["engine.kind=vllm_colocate", "rollout.temperature=1"])
    assert lines(colocated, NODE)[0] == ("engine.gpu_memory_utilization = 0.4 (auto: vLLM in the trainer's process, "
                                         "on its GPU)")


def test_the_hub_teacher_recipe_of_the_docs_is_distillation_and_fits_a_three_gpu_machine():
    """docs/comparing-teachers.md's Qwen3-8B -> Qwen3-1.7B GSM8K command, as a GPU machine reads it."""
    from pathlib import Path

    from selfopd.engines.gpu_layout import check_layout

    text = (Path(__file__).resolve().parents[2] / "docs/comparing-teachers.md").read_text()
    command = text.split("## A larger teacher online", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    sets = [word.strip('"') for word in command.replace("\\\n", " ").split() if "=" in word]
    config = resolve_auto(load_config(command.split()[2], sets, resolve=False), Machine(cuda=True, gpu_count=3))
    assert (config.loss.lambda_opd, config.loss.lambda_rl, config.model.dtype) == (1.0, 0.0, "bfloat16")
    assert [server.gpus for server in check_layout(config, [0], 3).servers] == [(1,), (2,)]
