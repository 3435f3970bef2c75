"""What each 'auto' setting of a training config means on a machine, and why: the lines
`selfopd train --show-config` prints below the config. The dtype rule is the config's own
(`selfopd.config.auto`); the servers' memory shares come from the GPU layout
(`selfopd.engines.gpu_layout`), the request timeout from `selfopd.engines.liveness`."""

from __future__ import annotations

from selfopd.config import TrainConfig
from selfopd.config.auto import Choice, Machine, auto_dtype, resolve_auto
from selfopd.engines.gpu_layout import COLOCATED_SHARE, check_layout, single_process_trainer_gpus
from selfopd.engines.liveness import timeout_rule


def auto_choices(config: TrainConfig, machine: Machine) -> list[Choice]:
    """Each 'auto' setting of the unresolved `config` with its value on `machine` and why."""
    choices = [auto_dtype(config, machine)] if config.model.dtype == "auto" else []
    resolved = resolve_auto(config, machine)
    if config.engine.kind != "local" and not config.engine.gpu_memory_utilization:
        choices += memory_choices(resolved, machine)
    if config.engine.kind != "local" and not config.engine.request_timeout_s:
        choices.append(Choice("engine.request_timeout_s", 0, timeout_rule()))
    return choices


def memory_choices(config: TrainConfig, machine: Machine) -> list[Choice]:
    """engine.gpu_memory_utilization of each server selfopd would launch for `config`."""
    key = "engine.gpu_memory_utilization"
    if not machine.cuda:
        return [Choice(key, 0, "no GPU: vLLM on a CPU uses engine.cpu_kv_cache_gb")]
    if config.engine.kind == "vllm_colocate":
        return [Choice(key, COLOCATED_SHARE, "vLLM in the trainer's process, on its GPU")]
    layout = check_layout(config, single_process_trainer_gpus(config.model.device, machine.gpu_count),
                          machine.gpu_count)
    return [Choice(f"{key} [{server}]", share, why) for server, (share, why) in layout.shares.items()]
