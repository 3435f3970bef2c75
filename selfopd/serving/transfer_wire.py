"""What the trainer and the vLLM workers must agree on to move weights: the group they join,
how a push is cut into packed chunks, and how a chunk is packed and unpacked.

Both sides of selfopd's weight transfer import this module (the trainer in
`selfopd.serving.weight_sync`, each server worker in `selfopd.serving.vllm_worker`), so
the two cannot cut the stream differently. The collective is the only thing that depends
on the hardware: a torch `ProcessGroupGloo` on the CPU, a `ProcessGroupNCCL` on GPUs, both
built the same way on a TCP store that trainer rank 0 hosts (`open_group`). Everything
else, a chunk's bytes included, is the same code on both.

Every socket of the group listens on one address, never on all of them: the store on the
trainer address (a socket bound here and handed to torch's TCPStore, which otherwise binds to
every interface), each rank's gloo pairs on its own address towards the trainer (an explicit
gloo device, not the host name's address), and NCCL on the interface of that address
(NCCL_SOCKET_IFNAME, when not set already).

Kept light: it runs inside vLLM's workers and imports nothing of selfopd's training code.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch

Backend = Literal["gloo", "nccl"]
BACKEND_NAME = "selfopd"  # the name under which the workers' engine is registered in vLLM


@dataclass
class TransferInit:
    """What one server's workers need to join the group (the body of `/init_weight_transfer_engine`).

    `rank_offset`: the group rank of the server's first worker (the trainer is rank 0; the
    servers of one group follow each other). `session` names this trainer's group, so a
    worker can tell a new trainer from the one it already serves. `secret`: the server's
    transfer secret (`selfopd.serving.server_auth.transfer_secret`), without which it refuses."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    backend: Backend = "gloo"
    timeout_s: float = 60.0
    session: str = ""
    secret: str = field(default="", repr=False)


@dataclass
class TransferUpdate:
    """One push's parameters, in the order the trainer sends them (the body of `/update_weights`).
    Both sides cut the same chunks from `sizes` and `buffer_bytes` (`chunk_ranges`)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buffer_bytes: int = 512 * 2**20
    version: int = 0
    session: str = ""  # the trainer's group (`TransferInit.session`): a worker that joined another refuses

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"{len(self.names)} names, {len(self.dtype_names)} dtypes and {len(self.shapes)} shapes")

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, name) for name in self.dtype_names]

    @property
    def sizes(self) -> list[int]:
        """Bytes of each parameter on the wire."""
        return [math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.shapes, self.dtypes)]


@dataclass
class Group:
    """One collective group over which trainer rank 0 broadcasts to every worker of its servers."""

    backend: Backend
    process_group: Any  # torch ProcessGroupGloo or ProcessGroupNCCL
    store: Any = field(repr=False)  # the TCP store the group was built on (rank 0 hosts it)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor`, waited for. NCCL orders the collective after
        what the current CUDA stream has queued (the packing of `tensor`), and the wait makes the
        current stream follow it; gloo works on CPU tensors."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.process_group.broadcast([tensor], options).wait()

    def close(self) -> None:
        for close in (getattr(self.process_group, "shutdown", None), getattr(self.process_group, "abort", None)):
            if callable(close):
                try:
                    close()
                    break
                except Exception:  # noqa: BLE001 - closing a group whose peer is gone must not raise
                    continue
        self.process_group = self.store = None  # rank 0's store stops listening once released


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port alone (port 0: a free one), for rank 0's store."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as error:  # socket.gaierror: not an address, a name that does not resolve
        raise OSError(f"cannot listen on {host}:{port} for the weight push (engine.trainer_address, "
                      f"engine.sync_port): {error.strerror or error}") from None
    listener = socket.socket(family, kind)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port} for the weight push (engine.trainer_address, "
                      f"engine.sync_port): {error.strerror or error}") from None
    return listener


def check_trainer_address(host: str) -> None:
    """Refuse, before any server starts or folder is made, an engine.trainer_address the weight push
    could not listen on (not an address of this machine, a name that does not resolve)."""
    from selfopd.config import ConfigError

    try:
        listen(host, 0).close()
    except OSError as error:
        raise ConfigError("engine.trainer_address", f"{host!r}: {str(error).partition('): ')[2] or error}; it must be "
                          "an address of this machine that the servers reach (the weight push listens there)") from None


def local_address_to(host: str) -> str:
    """This machine's address on the route to `host` (the host itself when it is this machine's)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: chooses the route, sends nothing
        return probe.getsockname()[0]


def reachable_address() -> str | None:
    """The address other machines reach this one at: the one on its default route (UDP: nothing is sent),
    else the first IPv4 address of an interface that is not loopback; None when it has none."""
    try:
        address = local_address_to("198.51.100.1")  # TEST-NET-2: routed by the default route, never sent to
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return next((item.address for items in psutil.net_if_addrs().values() for item in items
                 if item.family == socket.AF_INET and not item.address.startswith("127.")), None)


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (e.g. 'lo' for 127.0.0.1), None if unknown here."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(item.address.split("%")[0] == address for item in addresses):
            return name
    return None


def nccl_interface(host: str) -> str | None:
    """NCCL_SOCKET_IFNAME for sockets towards `host`: '=' and the interface of this machine's address
    on that route (exact, not a prefix); None when it cannot be told (`host` does not resolve)."""
    try:
        interface = interface_of(local_address_to(host))
    except OSError:
        return None
    return f"={interface}" if interface else None


def open_group(host: str, port: int, rank: int, world_size: int, backend: Backend, timeout_s: float,
               listener: socket.socket | None = None) -> Group:
    """Join the group on the TCP store at host:port (rank 0 hosts it and must be the trainer, on
    `listener` when given, else on a socket bound to host:port here).

    `timeout_s` bounds the rendezvous and every collective: a peer that died makes the
    broadcast fail within it (gloo usually notices a closed connection at once)."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    own = local_address_to(host)  # where this rank's sockets listen: the trainer's address on rank 0
    if rank == 0:
        listener = listener or listen(host, port)
        port = listener.getsockname()[1]
        store = TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())  # the store owns (and closes) the socket
    else:
        store = TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore(f"selfopd-weights-{port}", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [ProcessGroupGloo.create_device(hostname=own)]
        group = ProcessGroupGloo(prefixed, rank, world_size, options)
    elif backend == "nccl":
        if not torch.distributed.is_nccl_available():
            raise RuntimeError("NCCL is not available in this torch build (torch.distributed.is_nccl_available() "
                               "is False): use engine.weight_sync = 'gloo'")
        from torch.distributed import ProcessGroupNCCL

        interface = nccl_interface(host)
        if interface:  # NCCL reads it when it first starts in this process (run on one H200 in a one-rank group
            # on loopback, the GPU check's `transfer`; towards another machine not yet run on a GPU)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"unknown weight-transfer backend {backend!r} (gloo or nccl)")
    return Group(backend, group, store)


def buffer_device(backend: Backend) -> torch.device:
    """Where a chunk lives on the wire: the current GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def chunk_ranges(sizes: Sequence[int], buffer_bytes: int) -> list[range]:
    """Consecutive parameter indices packed together: a chunk takes parameters until it holds at
    least `buffer_bytes` (a parameter larger than that is a chunk of its own). Both sides call it."""
    ranges, start, held = [], 0, 0
    for index, size in enumerate(sizes):
        held += size
        if held >= buffer_bytes:
            ranges.append(range(start, index + 1))
            start, held = index + 1, 0
    if start < len(sizes):
        ranges.append(range(start, len(sizes)))
    return ranges


def pack(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Tensors, each contiguous, as one uint8 buffer on `device` (copied, in order)."""
    flat = [tensor.detach().to(device).contiguous().view(-1).view(torch.uint8) for tensor in tensors]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)


def unpack(buffer: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]],
           dtypes: Sequence[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors a `pack`ed buffer holds: views of it, in order (a copy where a tensor of
    mixed dtypes starts off its dtype's alignment; a push sends one dtype, so never then)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"a chunk of {buffer.numel()} bytes cannot hold {len(names)} tensors of {sum(sizes)} bytes")
    for name, shape, dtype, part in zip(names, shapes, dtypes, buffer.split(sizes)):
        aligned = part if part.storage_offset() % dtype.itemsize == 0 else part.clone()
        yield name, aligned.view(dtype).view(list(shape))
