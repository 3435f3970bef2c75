"""The memory plan `selfopd train` checks on GPUs before the run folder is made and before any
weights load (engine.check_memory_plan): the one-line refusal `selfopd plan` prints, with the fix,
when a GPU cannot hold what the run puts on it. On a CPU it does nothing."""

from __future__ import annotations

import sys

from selfopd.config import ConfigError
from selfopd.config.auto import Machine, trainer_on_cuda
from selfopd.config.bundles import PlanSettings

KEY = "engine.check_memory_plan"


def memory_plan_refusal(settings: PlanSettings, machine: Machine, gpu: tuple[str, float] | None,
                        world: int) -> str | None:
    """The plan's refusal for a run (its config's sections) trained by `world` ranks on `machine`, whose GPUs
    are `gpu` ((name, GiB) of GPU 0; None: no GPU); None when it fits, on a CPU, or when the check is off."""
    if not settings.engine.check_memory_plan or gpu is None or not trainer_on_cuda(settings.model.device, machine):
        return None
    from selfopd.planning.memory_fit import plan_run

    name, capacity_gib = gpu
    plan = plan_run(settings, capacity_gib=capacity_gib, gpu_name=name, on_gpu=True, world=world,
                    gpu_count=machine.gpu_count or None)
    return plan.refusal()


def check_memory_plan(settings: PlanSettings, world: int, machine: Machine | None = None,
                      gpu: tuple[str, float] | None = None) -> None:
    """Refuse (ConfigError naming engine.check_memory_plan) a GPU run whose memory plan does not fit this
    machine's GPUs; `machine` and `gpu` default to this machine's."""
    from selfopd.planning import memory_fit

    machine = machine or Machine.here()
    if gpu is None and machine.cuda:
        gpu = memory_fit.detected_gpu()
    try:
        refusal = memory_plan_refusal(settings, machine, gpu, world)
    except ConfigError:  # a config.json that cannot be read: the model could not load either
        raise
    except Exception as error:  # a model the planner cannot build on the meta device: train without the check
        first = (str(error).strip().splitlines() or [""])[0]
        print(f"warning: {KEY}: no memory plan for this run ({type(error).__name__}: {first}); starting without it",
              file=sys.stderr)
        return
    if refusal:
        raise ConfigError(KEY, f"{refusal} (selfopd plan prints the whole plan; {KEY} = false starts without "
                               "this check)")
