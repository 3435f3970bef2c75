"""What the 'auto' settings of a training config mean on a given machine, decided here and nowhere
else, by pure functions of a `Machine` (so CPU tests drive the GPU rules), and applied once, when a
config is built (`selfopd.config.build_config`): no code downstream ever sees `model.dtype = 'auto'`.
The memory planner, which plans for GPUs it does not run on, and `--show-config` ask this module too
(`run_dtype`, `dtype_choices`).

- `model.dtype = 'auto'`: 'bfloat16' when the trainer runs on a CUDA GPU, 'float32' on a CPU
  (what every CPU run computed before 'auto' existed), and 'float32' with LoRA and a vLLM engine
  (bf16 is refused there: vLLM would round the adapters' small update away).
- LoRA with vLLM engines in bf16 (`lora_on_vllm`, the one statement of the rule): refused unless
  `model.lora_bf16_servers` (`check_lora_dtype`, from `TrainConfig.__post_init__`); 'auto' avoids it.

`engine.gpu_memory_utilization = 0` is resolved per server from the GPU layout
(`selfopd.serving.gpu_layout.server_shares`) and `engine.request_timeout_s = 0` per request from
its work (`selfopd.serving.liveness.request_ceiling`); `selfopd.planning.auto_settings` says what
each became and why, for `selfopd train --show-config`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfopd.config.compute import VLLM_KINDS, EngineConfig, ModelConfig
from selfopd.config.settings import fail

if TYPE_CHECKING:
    from selfopd.config import TrainConfig


@dataclass(frozen=True)
class Machine:
    """What the auto rules need to know of the machine a config runs on."""

    cuda: bool  # a CUDA device is visible
    gpu_count: int = 0

    @staticmethod
    @functools.cache
    def here() -> Machine:
        """This process's machine (torch is imported only here, the first time)."""
        import torch

        cuda = torch.cuda.is_available()
        return Machine(cuda=cuda, gpu_count=torch.cuda.device_count() if cuda else 0)


@dataclass(frozen=True)
class Choice:
    """One auto-resolved setting: its key, the value chosen and why."""

    key: str
    value: object
    why: str

    def line(self) -> str:
        return f"{self.key} = {self.value} (auto: {self.why})"


def trainer_on_cuda(device: str, machine: Machine) -> bool:
    """Whether `model.device` puts the trainer on a GPU of `machine`."""
    return device != "cpu" and (device != "auto" or machine.cuda)


def lora_on_vllm(model: ModelConfig, engine: EngineConfig) -> bool:
    """LoRA whose servers are vLLM (launched or colocated): they hold W + dW in model.dtype, so bf16 rounds
    an update far below W's resolution away."""
    return model.lora and engine.kind in VLLM_KINDS


def check_lora_dtype(model: ModelConfig, engine: EngineConfig) -> None:
    """Refuse LoRA with vLLM engines in bf16 unless model.lora_bf16_servers accepts it."""
    if model.dtype == "bfloat16" and lora_on_vllm(model, engine) and not model.lora_bf16_servers:
        fail("model.lora_rank", f"LoRA with model.dtype = 'bfloat16' and engine.kind = {engine.kind!r} is "
             "refused: vLLM would serve W + dW rounded to bf16, and an update far below bf16's resolution of W "
             "(dW of std 1e-5 on weights of std 0.02) mostly rounds away, so the servers would sample and score "
             "close to the base model; use model.dtype = 'float32' or engine.kind = 'local' with LoRA, or accept "
             "it with model.lora_bf16_servers = true (what OPSD's code does)")


def auto_dtype(model: ModelConfig, engine: EngineConfig, machine: Machine) -> Choice:
    """What `model.dtype = 'auto'` means for these sections on `machine`."""
    if not trainer_on_cuda(model.device, machine):
        return Choice("model.dtype", "float32", "CPU device")
    if lora_on_vllm(model, engine):
        return Choice("model.dtype", "float32", "CUDA device, but LoRA with a vLLM engine is refused in bf16")
    return Choice("model.dtype", "bfloat16", "CUDA device")


def dtype_choices(model: ModelConfig, engine: EngineConfig, machine: Machine) -> list[Choice]:
    """[what model.dtype = 'auto' becomes on `machine`, and why]; [] when model.dtype is not 'auto'."""
    return [auto_dtype(model, engine, machine)] if model.dtype == "auto" else []


def run_dtype(model: ModelConfig, engine: EngineConfig, machine: Machine) -> str:
    """model.dtype as a run on `machine` uses it: 'auto' resolved, any other value as it is."""
    return str(choices[0].value) if (choices := dtype_choices(model, engine, machine)) else model.dtype


def resolve_auto(config: TrainConfig, machine: Machine) -> TrainConfig:
    """`config` with model.dtype = 'auto' replaced by what it means on `machine` (the same
    config when nothing is 'auto'); the rules across sections are checked again on the result."""
    if config.model.dtype != "auto":
        return config
    model = dataclasses.replace(config.model, dtype=run_dtype(config.model, config.engine, machine))
    return dataclasses.replace(config, model=model)
