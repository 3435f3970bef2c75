"""What the 'auto' settings of a training config mean on a given machine, decided by pure
functions of a `Machine` (so CPU tests drive the GPU rules) and applied once, when a config is
built (`selfopd.config.build_config`): no code downstream ever sees `model.dtype = 'auto'`.

- `model.dtype = 'auto'`: 'bfloat16' when the trainer runs on a CUDA GPU, 'float32' on a CPU
  (what every CPU run computed before 'auto' existed), and 'float32' with LoRA and a vLLM engine
  (bf16 is refused there: vLLM would round the adapters' small update away).

`engine.gpu_memory_utilization = 0` is resolved per server from the GPU layout
(`selfopd.engines.gpu_layout.server_shares`) and `engine.request_timeout_s = 0` per request from
its work (`selfopd.engines.vllm.request_ceiling`); `auto_choices` says what each became and why,
for `selfopd train --show-config`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfopd.config.compute import VLLM_KINDS

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


def auto_dtype(config: TrainConfig, machine: Machine) -> Choice:
    """What `model.dtype = 'auto'` means for `config` on `machine`."""
    if not trainer_on_cuda(config.model.device, machine):
        return Choice("model.dtype", "float32", "CPU device")
    if config.model.lora and config.engine.kind in VLLM_KINDS:
        return Choice("model.dtype", "float32", "CUDA device, but LoRA with a vLLM engine is refused in bf16")
    return Choice("model.dtype", "bfloat16", "CUDA device")


def resolve_auto(config: TrainConfig, machine: Machine) -> TrainConfig:
    """`config` with model.dtype = 'auto' replaced by what it means on `machine` (the same
    config when nothing is 'auto'); the rules across sections are checked again on the result."""
    if config.model.dtype != "auto":
        return config
    model = dataclasses.replace(config.model, dtype=auto_dtype(config, machine).value)
    return dataclasses.replace(config, model=model)
