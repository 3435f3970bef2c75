"""The lines `selfopd train --show-config` prints for each 'auto' setting: what it means on a
stated machine (no GPU here) and why."""

from __future__ import annotations

import dataclasses

from selfopd.config import TrainConfig, load_config
from selfopd.config.auto import Machine
from selfopd.config.bundles import ServingSettings
from selfopd.planning.auto_settings import auto_choices

CPU, NODE = Machine(cuda=False), Machine(cuda=True, gpu_count=8)


def lines(config: TrainConfig, machine: Machine) -> list[str]:
    return [choice.line() for choice in auto_choices(ServingSettings.of(config), machine)]


def test_choices_name_each_auto_setting_and_why():
    assert lines(load_config(None, resolve=False), NODE) == ["model.dtype = bfloat16 (auto: CUDA device)"]
    assert lines(load_config(None), NODE) == []  # resolved: nothing left to choose for the local engine
    node = load_config(None, ["engine.kind=vllm", "rollout.temperature=1", "engine.student_gpus=1",
                              "engine.teacher_gpus=2", "model.device=cuda:0"], resolve=False)
    chosen = lines(node, NODE)
    assert chosen[:3] == ["model.dtype = bfloat16 (auto: CUDA device)",
                          "engine.gpu_memory_utilization [student] = 0.9 (auto: server alone on GPU 1)",
                          "engine.gpu_memory_utilization [teacher] = 0.9 (auto: server alone on GPU 2)"]
    assert chosen[3].startswith("engine.request_timeout_s = 0 (auto: no fixed timeout: each request may take 600 s")
    assert lines(dataclasses.replace(node, engine=dataclasses.replace(node.engine, request_timeout_s=60.0,
                                                                      gpu_memory_utilization=0.5)), NODE) == \
        ["model.dtype = bfloat16 (auto: CUDA device)"]  # explicit values are not 'auto'
    assert lines(node, CPU)[1] == ("engine.gpu_memory_utilization = 0 (auto: no GPU: vLLM on a CPU uses "
                                   "engine.cpu_kv_cache_gb)")
    colocated = load_config(None, ["engine.kind=vllm_colocate", "rollout.temperature=1"])
    assert lines(colocated, NODE)[0] == ("engine.gpu_memory_utilization = 0.4 (auto: vLLM in the trainer's process, "
                                         "on its GPU)")
