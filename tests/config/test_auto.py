"""The 'auto' settings: pure functions of a stated machine (no GPU here), so the CUDA rules are
tested by saying there is one; on this CPU machine a loaded config computes what it always did."""

from __future__ import annotations

import dataclasses

import pytest

from selfopd.config import TrainConfig, load_config
from selfopd.config.auto import Machine, auto_dtype, resolve_auto

CPU, NODE = Machine(cuda=False), Machine(cuda=True, gpu_count=8)


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
    choice = auto_dtype(config.model, config.engine, machine)
    assert (choice.value, choice.why) == (dtype, why)
    resolved = resolve_auto(config, machine)
    assert resolved.model.dtype == dtype and resolve_auto(resolved, CPU) == resolved  # once, then fixed
    assert dataclasses.replace(resolved, model=config.model) == config  # nothing else changes


def test_the_hub_teacher_recipe_of_the_docs_is_distillation_and_fits_a_three_gpu_machine():
    """docs/comparing-teachers.md's Qwen3-8B -> Qwen3-1.7B GSM8K command, as a GPU machine reads it."""
    from pathlib import Path

    from selfopd.serving.gpu_layout import check_layout

    text = (Path(__file__).resolve().parents[2] / "docs/comparing-teachers.md").read_text()
    command = text.split("## A larger teacher online", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    sets = [word.strip('"') for word in command.replace("\\\n", " ").split() if "=" in word]
    config = resolve_auto(load_config(command.split()[2], sets, resolve=False), Machine(cuda=True, gpu_count=3))
    assert (config.loss.lambda_opd, config.loss.lambda_rl, config.model.dtype) == (1.0, 0.0, "bfloat16")
    assert [server.gpus for server in check_layout(config.engine, config.teacher, [0], 3).servers] == [(1,), (2,)]
