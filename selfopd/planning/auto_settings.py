"""What each 'auto' setting of a training config means on a machine, and why: the lines
`selfopd train --show-config` prints below the config. The dtype rule is decided by
`selfopd.config.auto` alone (asked here, never restated); the servers' memory shares come from the
GPU layout (`selfopd.serving.gpu_layout`), the request timeout from `selfopd.serving.liveness`."""

from __future__ import annotations

from selfopd.config.auto import Choice, Machine, dtype_choices
from selfopd.config.bundles import ServingSettings
from selfopd.serving.gpu_layout import COLOCATED_SHARE, check_layout, single_process_trainer_gpus
from selfopd.serving.liveness import timeout_rule


def auto_choices(settings: ServingSettings, machine: Machine) -> list[Choice]:
    """Each 'auto' setting of the unresolved config's sections with its value on `machine` and why."""
    engine = settings.engine
    choices = dtype_choices(settings.model, engine, machine)
    if engine.kind != "local" and not engine.gpu_memory_utilization:
        choices += memory_choices(settings, machine)
    if engine.kind != "local" and not engine.request_timeout_s:
        choices.append(Choice("engine.request_timeout_s", 0, timeout_rule()))
    return choices


def memory_choices(settings: ServingSettings, machine: Machine) -> list[Choice]:
    """engine.gpu_memory_utilization of each server selfopd would launch for these sections."""
    key = "engine.gpu_memory_utilization"
    if not machine.cuda:
        return [Choice(key, 0, "no GPU: vLLM on a CPU uses engine.cpu_kv_cache_gb")]
    if settings.engine.kind == "vllm_colocate":
        return [Choice(key, COLOCATED_SHARE, "vLLM in the trainer's process, on its GPU")]
    layout = check_layout(settings.engine, settings.teacher,
                          single_process_trainer_gpus(settings.model.device, machine.gpu_count), machine.gpu_count)
    return [Choice(f"{key} [{server}]", share, why) for server, (share, why) in layout.shares.items()]
