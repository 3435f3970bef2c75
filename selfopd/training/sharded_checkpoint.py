"""Sharded checkpoints (run.checkpoint_format = 'sharded'): every rank writes its own part of
the weights and optimizer state with torch.distributed.checkpoint (DCP), which reads them back
on any number of ranks, resharding as it loads. Nothing is gathered to rank 0.

With run.checkpoint_async the write runs in the background: DCP first copies the state to
memory (the training then goes on changing the live tensors), then writes the copy from a
thread. A checkpoint counts only once it is renamed into place, which rank 0's writing thread
does as soon as its write has finished: DCP's metadata, which rank 0 writes last, exists only
once every rank's part is written. A kill during the write leaves a staging folder, never a
checkpoint, so a resume starts from the previous complete one."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from selfopd.core.distributed import World
from selfopd.core.faults import fault_point
from selfopd.core.file_checks import DCP_FOLDER, is_sharded_checkpoint  # noqa: F401  (public here too)

# DCP warns that one process (no process group) reads or writes alone, which is meant; a background
# write warns on its own thread, which a `catch_warnings` around the call would not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def training_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as DCP reads and writes it: each rank's own shards
    (DTensors under FSDP2), keyed by parameter name, so any number of ranks can load it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def load_sharded(model: Any, optimizer: torch.optim.Optimizer, checkpoint: Path, world: World) -> None:
    """Restore the weights and optimizer state of a sharded checkpoint into this rank's (sharded)
    model and optimizer, whatever the number of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = training_state(model, optimizer)
    dcp.load(state, checkpoint_id=Path(checkpoint) / DCP_FOLDER, process_group=checkpoint_group(world),
             no_dist=not world.distributed)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


_GROUP: list[Any] = []  # this process's gloo group for checkpoints, made once


def checkpoint_group(world: World) -> Any:
    """A gloo group of every rank for DCP's own collectives (None on one process): a background
    write's collectives run on a thread, so they must not share the training's group (NCCL on
    GPUs), and DCP's background writes need a CPU backend. Every rank makes it at the same call."""
    if not world.distributed:
        return None
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


@dataclass
class _Write:
    """One write of shards, and what makes it a checkpoint once written (`finish`: rank 0 renames the
    folder into place), run once: by the writing thread as soon as the write is done, else by `wait`."""
    future: Future | None  # None: written already (a synchronous save)
    finish: Callable[[], None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False
    error: BaseException | None = None  # raised by `finish` on the writing thread: raised again by `wait`

    def complete(self) -> None:
        with self.lock:
            if self.finished:
                return
            self.finished = True
            fault_point("checkpoint.shards")  # every rank's shards written, the folder not yet in place
            try:
                self.finish()
            except BaseException as error:  # on the writing thread nothing would see it
                self.error = error

    def when_written(self, future: Future) -> None:
        if future.exception() is None:
            self.complete()


class ShardedWriter:
    """One checkpoint write at a time, in the background or not. A background write is put in place
    by its own thread once written; `wait` (before the next write, a stop, the run's end) blocks until
    it is, and raises what failed."""

    def __init__(self, world: World, background: bool):
        self.world, self.background = world, background
        self._pending: _Write | None = None

    def write(self, model: Any, optimizer: torch.optim.Optimizer, folder: Path, finish: Callable[[], None]) -> None:
        """Write the shards under `folder`/dcp (every rank calls it), then `finish()` once written."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        state = training_state(model, optimizer)
        options = {"checkpoint_id": Path(folder) / DCP_FOLDER, "process_group": checkpoint_group(self.world),
                   "no_dist": not self.world.distributed}
        if self.background:
            future = dcp.async_save(state, **options)  # returns once the state is copied to memory
            self._pending = _Write(future, finish)
            future.add_done_callback(self._pending.when_written)
            return
        dcp.save(state, **options)
        self._pending = _Write(None, finish)
        self.wait()

    def wait(self) -> None:
        """Block until the write in flight is written and in place; a failed write raises here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        pending.complete()
        if pending.error is not None:
            raise pending.error
