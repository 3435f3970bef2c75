"""Training on several processes: `torchrun --nproc_per_node N -m selfopd train CONFIG`.

torch.distributed does the work; this module only says who this process is and wraps the
few collectives the trainer needs. The student (and an in-process frozen or external
teacher) is sharded with FSDP2 (`fully_shard`: each decoder layer, then the whole model),
so a rank holds 1/N of the weights, gradients and AdamW state. Each rank takes a
contiguous share of the step's prompts and does everything for them (sampling, teacher
scoring, loss); gradients are reduced over ranks so the step equals one process's step
on the whole batch. Rank 0 alone writes (metrics, rollouts, evals, checkpoints) and talks
to vLLM servers' weight sync. Everything else runs on every rank in the same order, since
an FSDP forward is a collective.

One process (no torchrun) is `World(rank=0, size=1)`: every helper is then a no-op.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """This process's place among the trainer's processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and drives the servers."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def current_world() -> World:
    """The world torchrun described in the environment (one process without it)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    return World(rank=int(os.environ["RANK"]), size=size, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def init_process_group(world: World, device: torch.device, timeout_s: float = 1800) -> None:
    """Join the trainer's process group: NCCL between GPUs, gloo on CPU. `timeout_s` bounds
    every collective, the wait for rank 0 to start vLLM servers included."""
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)


def padded_share(items: Sequence[T], world: World) -> tuple[list[T], int]:
    """This rank's contiguous block of ceil(len(items) / ranks) of `items` (the step's prompts), and how
    many of them are real. A block past the end is filled with the first items again: padding, which the
    rank runs like the others (so every rank makes the same calls into each collective) and which weighs
    nothing (`selfopd.training.step`)."""
    if not items:
        raise ValueError("no items to share")
    size = -(-len(items) // world.size)
    real = list(items[world.rank * size : (world.rank + 1) * size])
    return real + [items[i % len(items)] for i in range(size - len(real))], len(real)


def all_gather(value: T, world: World) -> list[T]:
    """Every rank's `value`, in rank order (any picklable object)."""
    if not world.distributed:
        return [value]
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, value)
    return gathered


def all_sum(value: float, world: World) -> float:
    """The sum of a number over ranks, in float64."""
    if not world.distributed:
        return value
    return sum(all_gather(float(value), world))


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def close_process_group() -> None:
    """Leave the process group once every rank is done with it (a no-op without one). Call it
    on success only, at the end of a torchrun entry point: a rank that exits with its gloo
    group alive can abort in the group's worker threads ("terminate called without an
    active exception") while its peers still finish; after an error a rank may never reach
    the barrier, and torchrun stops the others anyway."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_model(model: Any, world: World) -> None:
    """FSDP2 in place: every decoder layer its own unit, the rest (embeddings, final norm,
    output head) the root; after a root forward the root stays gathered until backward,
    which is what lets the trainer apply the output head to the final hidden states itself."""
    if not world.distributed:
        return
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    # `generate` does not go through the top module's forward when peft wraps it (LoRA):
    # registered, it runs FSDP's root hooks like a forward.
    register_fsdp_forward_method(model, "generate")


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered_for_generation(model: Any) -> Iterator[None]:
    """Generation runs one forward per new token: gather every layer once for the whole of
    it (instead of once per token), then shard again. A no-op for an unsharded model."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)  # the root's own setting (see shard_model)
        for unit in units:
            unit.reshard()


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters by HF name (a tied head once), whole: on the CPU of rank 0
    ({} on other ranks) for a sharded model, where every rank must call it."""
    if not is_sharded(model):
        return {name: param.detach() for name, param in model.named_parameters()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: full[name] for name, _ in model.named_parameters() if name in full}


def full_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, world: World) -> dict[str, Any]:
    """The optimizer's state in torch's own layout (state keyed by parameter index, as
    `optimizer.state_dict()` of one process), whole, on rank 0: checkpoints read the same
    whatever the number of ranks that wrote them."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not world.is_main:
        return {}
    index = {name: i for i, name in enumerate(_optimized_names(model, optimizer))}
    return {
        "state": {index[name]: value for name, value in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in by_name["param_groups"]],
    }


def load_optimizer_state(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore `full_optimizer_state`'s layout into this rank's (sharded) optimizer."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _optimized_names(model, optimizer)
    by_name = {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _optimized_names(model: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own order (the indices of its state dict)."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    return [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]


class ShardedSampling:
    """An engine's `sample` with the prompts spread over the ranks and the rollouts gathered
    back: every rank calls it with the same prompts (an eval batch) and gets every rollout.
    Shares are equal (the last is padded with copies of a prompt, dropped after), since a
    sharded model's generation is a collective that every rank must run alike."""

    def __init__(self, engine: Any, world: World) -> None:
        self.engine = engine
        self.world = world

    def sample(self, prompts: Sequence[list[int]], params: Any) -> list[list[Any]]:
        if not self.world.distributed:
            return self.engine.sample(prompts, params)
        per_rank = -(-len(prompts) // self.world.size)
        start = self.world.rank * per_rank
        mine = list(prompts[start : start + per_rank])
        real = len(mine)
        mine += [list(prompts[0])] * (per_rank - real)
        rollouts = self.engine.sample(mine, replace(params, first_row=params.first_row + start * params.n))[:real]
        return [group for part in all_gather(rollouts, self.world) for group in part]
