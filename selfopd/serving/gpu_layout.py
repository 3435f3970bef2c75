"""Which GPU does what in a run with launched vLLM servers, decided and checked before anything starts.

A run on GPUs has trainer processes (one, or one per local rank under torchrun) and
vLLM servers: `engine.student_servers` student servers on `engine.student_gpus`
(`engine.tensor_parallel_size` each, in order) and a teacher server on
`engine.teacher_gpus`. The rules, each refused with one line naming the GPUs and keys:

- With `engine.weight_sync = "nccl"`, the trainer's rank 0 and the workers of every
  server that serves the student's weights (the student servers, a `self` teacher's)
  join one NCCL group (servers sharing a GPU go to separate groups,
  `selfopd.serving.launch.transfer_groups`), and NCCL refuses two ranks of one group on
  one GPU ("Duplicate GPU detected"). Such a server must not sit on a trainer GPU, and
  must be placed explicitly on a GPU machine: vLLM's default placement (GPUs 0..TP-1)
  knows nothing of the trainer. A CPU trainer's NCCL endpoint is CUDA's current device, GPU 0.
- Every GPU named must be visible, and one server names a GPU once.
- Servers may share a GPU (vLLM's `gpu_memory_utilization` is a per-instance budget):
  refused when the servers on one GPU ask for more than 0.95 of it together (the rest
  holds the weight push's receive chunks, `engine.sync_buffer_mb`, and the communicator).
- `engine.gpu_memory_utilization = 0` gives each server its share from the layout
  (`server_shares`): 0.9 of each of its GPUs, less 0.5 on a GPU the trainer uses, split evenly
  among the servers there; a server on several GPUs takes its smallest share.

Not refused, only warned: a server that is not in the weight sync (a `frozen` or
`external` teacher) on a trainer GPU (memory, not NCCL), a gloo push to a server on a
trainer GPU, and GPU keys that mean nothing because the servers are given by URL (one
config serves `selfopd serve` on the server node and `selfopd train --set
engine.student_urls=...` on the trainer node).

GPU indices are those this process sees (after its own CUDA_VISIBLE_DEVICES), as torch's
`cuda:N` and `torch.cuda.device_count()` do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from selfopd.config import EngineConfig, TeacherConfig, fail

MAX_SERVER_SHARE = 0.95  # of one GPU, for the vLLM servers on it together
ALONE_SHARE = 0.9  # engine.gpu_memory_utilization = 0: what the servers on a GPU take together...
TRAINER_SHARE = 0.5  # ...less this where a trainer rank computes
COLOCATED_SHARE = 0.4  # vllm_colocate: vLLM in the trainer's process, on its GPU


@dataclass(frozen=True)
class ServerSlot:
    """One server selfopd launches: its name, port and GPUs, and whether the weight sync reaches it."""

    name: str  # "student", "student-0", "student-1", ..., "teacher", "teacher-0", ... (`role` says which)
    port: int
    gpus: tuple[int, ...]  # () = vLLM's default placement (CPU, or GPUs 0..TP-1)
    tensor_parallel_size: int
    synced: bool  # sent weights every step: a student server, a `self` teacher's, an `ema` teacher's

    @property
    def role(self) -> str:
        return server_role(self.name)

    @property
    def gpu_key(self) -> str:
        return f"engine.{self.role}_gpus"


def server_role(name: str) -> str:
    """'teacher' or 'student': the role of the launched server `name` (a ServerSlot's, a ServerSpec's)."""
    return "teacher" if name == "teacher" or name.startswith("teacher-") else "student"


@dataclass(frozen=True)
class GPULayout:
    """The checked placement: who runs on which GPU, and what was only warned about."""

    gpu_count: int
    trainer_gpus: tuple[int, ...] | None  # None: no trainer on this machine (`selfopd serve`)
    servers: tuple[ServerSlot, ...]
    sync: str  # "nccl" or "gloo"
    url_servers: tuple[tuple[str, str], ...] = ()  # (role, URL) of servers given by URL
    warnings: tuple[str, ...] = ()
    # server name -> (its gpu_memory_utilization, why): engine.gpu_memory_utilization, or from the layout (0)
    shares: dict[str, tuple[float, str]] = field(default_factory=dict)

    def uses(self) -> dict[int | None, list[str]]:
        """GPU index -> what runs there (None: no GPU index, i.e. CPU or vLLM's own choice)."""
        uses: dict[int | None, list[str]] = defaultdict(list)
        for rank, gpu in enumerate(self.trainer_gpus or ()):
            uses[gpu].append(f"trainer local rank {rank}" + (" (weight-sync NCCL rank 0)" if rank == 0 and
                                                              self.sync == "nccl" and self.servers_synced() else ""))
        if self.trainer_gpus == () and self.gpu_count and self.sync == "nccl" and self.servers_synced():
            uses[0].append("CPU trainer's weight-sync NCCL endpoint")
        for server in self.servers:
            sync = "weights synced" if server.synced else "fixed weights"
            gpus = server.gpus or tuple(range(server.tensor_parallel_size) if self.gpu_count else ())
            for shard, gpu in enumerate(gpus or (None,)):
                placed = "" if server.gpus or gpu is None else ", vLLM's default placement"
                uses[gpu].append(f"{server.name} server :{server.port} (TP shard {shard} of "
                                 f"{server.tensor_parallel_size}, {sync}{placed})")
        return uses

    def servers_synced(self) -> bool:
        return any(server.synced for server in self.servers) or any(role == "student" for role, _ in self.url_servers)

    def table(self) -> str:
        """A one-table summary for the run log: each GPU and what runs on it."""
        trainer = ("no trainer on this machine" if self.trainer_gpus is None
                   else f"trainer GPUs {list(self.trainer_gpus)}" if self.trainer_gpus else "trainer on CPU")
        lines = [f"GPU layout: {self.gpu_count} visible GPU(s), {trainer}, weight sync {self.sync}",
                 f"  {'GPU':<5}what runs there"]
        uses = self.uses()
        for gpu in sorted((g for g in uses if g is not None)):
            lines.append(f"  {gpu:<5}" + "; ".join(uses[gpu]))
        for use in uses.get(None, []):
            lines.append(f"  {'-':<5}{use}")
        idle = sorted(set(range(self.gpu_count)) - set(uses))
        if idle:
            lines.append(f"  idle GPUs: {', '.join(map(str, idle))}")
        for role, url in self.url_servers:
            lines.append(f"  {role} server given by URL: {url} (placed where it runs)")
        lines += [f"  warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def resolved_sync(engine: EngineConfig, gpu_count: int) -> str:
    """'gloo' or 'nccl': what engine.weight_sync = 'auto' means on a machine with `gpu_count` GPUs."""
    if engine.weight_sync != "auto":
        return engine.weight_sync
    return "nccl" if gpu_count > 0 else "gloo"


def single_process_trainer_gpus(device: str, gpu_count: int) -> list[int]:
    """The GPU of a trainer that is one process on `model.device` ('auto', 'cpu', 'cuda', 'cuda:N').

    Under torchrun the distributed code knows the local ranks' GPUs and passes them instead."""
    if device == "cpu" or (device == "auto" and gpu_count == 0):
        return []
    return [int(device.split(":")[1])] if ":" in device else [0]


def server_slots(engine: EngineConfig, teacher: TeacherConfig) -> list[ServerSlot]:
    """The servers selfopd launches for `engine` and `teacher` (those not given by URL), in start order.

    Student server i takes port engine.port + i and GPUs student_gpus[i*TP:(i+1)*TP]; the
    teacher server j takes the port after the launched students' + j (engine.port + j when the students are
    given by URL) and GPUs teacher_gpus[j*TP:(j+1)*TP]."""
    slots = []
    if not engine.urls("student_urls"):
        tp, gpus = engine.tensor_parallel_size, engine.gpus("student_gpus")
        for i in range(engine.student_servers):
            slots.append(ServerSlot(name="student" if engine.student_servers == 1 else f"student-{i}",
                                    port=engine.port + i, gpus=tuple(gpus[i * tp:(i + 1) * tp]),
                                    tensor_parallel_size=tp, synced=True))
    # No server for a teacher the trainer scores (engine.teacher_engine = 'local') or for none at all.
    if engine.teacher_engine == "vllm" and teacher.kind != "none" and not engine.urls("teacher_url"):
        tp, gpus, count = engine.teacher_parallel_size(), engine.gpus("teacher_gpus"), engine.teacher_servers
        first = engine.port + len(slots)  # the port after the launched students'
        for j in range(count):
            slots.append(ServerSlot(name="teacher" if count == 1 else f"teacher-{j}",
                                    port=first + j, gpus=tuple(gpus[j * tp:(j + 1) * tp]),
                                    tensor_parallel_size=tp, synced=teacher.receives_weights))
    return slots


def check_layout(engine: EngineConfig, teacher: TeacherConfig, trainer_gpus: Sequence[int] | None,
                 gpu_count: int) -> GPULayout:
    """The run's GPU layout, or a ConfigError naming the GPUs and keys of the first rule broken.

    `trainer_gpus`: the GPUs of this node's trainer ranks in local-rank order ([] for a CPU
    trainer; None when no trainer runs here, as in `selfopd serve`). `gpu_count`: the GPUs
    this process sees. Call it before any server starts or model loads."""
    sync = resolved_sync(engine, gpu_count)
    slots = server_slots(engine, teacher)
    trainer = None if trainer_gpus is None else tuple(trainer_gpus)
    _check_visible(engine, slots, trainer or (), gpu_count)
    warnings = _url_warnings(engine)
    shares = server_shares(slots, trainer or (), gpu_count, engine.gpu_memory_utilization)
    if trainer is not None and gpu_count:
        warnings += _check_trainer_gpus(slots, trainer, sync, shares)
    if gpu_count:
        _check_memory(slots, shares)
    return GPULayout(gpu_count=gpu_count, trainer_gpus=trainer, servers=tuple(slots), sync=sync,
                     url_servers=tuple([("student", url) for url in engine.urls("student_urls")]
                                       + [("teacher", url) for url in engine.urls("teacher_url")]),
                     warnings=tuple(warnings), shares=shares)


def _placed(slot: ServerSlot, gpu_count: int) -> tuple[int, ...]:
    """The GPUs a server runs on: its own, else vLLM's default 0..TP-1 (none on a CPU machine)."""
    return slot.gpus or (tuple(range(slot.tensor_parallel_size)) if gpu_count else ())


def server_shares(slots: Sequence[ServerSlot], trainer: Sequence[int], gpu_count: int,
                  utilization: float) -> dict[str, tuple[float, str]]:
    """Each server's gpu_memory_utilization and why: `utilization` when set (> 0), else from the
    layout: ALONE_SHARE of each of its GPUs, less TRAINER_SHARE on a trainer GPU, split evenly
    among the servers there (rounded down to 0.01); the smallest over its GPUs."""
    if utilization:
        return {slot.name: (utilization, "engine.gpu_memory_utilization") for slot in slots}
    on_gpu: dict[int, list[str]] = defaultdict(list)
    for slot in slots:
        for gpu in _placed(slot, gpu_count):
            on_gpu[gpu].append(slot.name)

    def share(gpu: int) -> tuple[float, str]:
        others, trained = len(on_gpu[gpu]) - 1, gpu in trainer
        free = ALONE_SHARE - (TRAINER_SHARE if trained else 0.0)
        company = [*(["the trainer"] if trained else []), *([f"{others} other server(s)"] if others else [])]
        why = f"server shares GPU {gpu} with {' and '.join(company)}" if company else f"server alone on GPU {gpu}"
        return int(free / (others + 1) * 100 + 1e-6) / 100, why

    return {slot.name: min([share(gpu) for gpu in _placed(slot, gpu_count)] or [(ALONE_SHARE, "no GPU")])
            for slot in slots}


def _check_visible(engine: EngineConfig, slots: Sequence[ServerSlot], trainer: Sequence[int], gpu_count: int) -> None:
    """Every GPU named exists here, and no server names one twice."""
    visible = f"this machine shows {gpu_count} GPU(s)" + (f" (0-{gpu_count - 1})" if gpu_count else "")
    for rank, gpu in enumerate(trainer):
        if gpu >= gpu_count:
            fail("model.device", f"trainer local rank {rank} is on GPU {gpu}, but {visible}")
    for slot in slots:
        for gpu in slot.gpus:
            if gpu >= gpu_count:
                fail(slot.gpu_key, f"GPU {gpu} of the {slot.name} server is not visible: {visible}")
        if len(set(slot.gpus)) != len(slot.gpus):
            fail(slot.gpu_key, f"the {slot.name} server's tensor-parallel GPUs {list(slot.gpus)} "
                               "name one GPU twice; each shard needs its own GPU")
        if not slot.gpus and gpu_count and slot.tensor_parallel_size > gpu_count:
            size_key = ("engine.teacher_tensor_parallel_size"
                        if slot.role == "teacher" and engine.teacher_tensor_parallel_size
                        else "engine.tensor_parallel_size")
            fail(size_key, f"the {slot.name} server needs {slot.tensor_parallel_size} GPUs, but {visible}")


def _check_trainer_gpus(slots: Sequence[ServerSlot], trainer: tuple[int, ...], sync: str,
                        shares: dict[str, tuple[float, str]]) -> list[str]:
    """Refuse a server of the NCCL weight sync on a trainer GPU (or left to vLLM's placement);
    the warnings for servers that share a trainer GPU without an NCCL group."""
    # A CPU trainer's NCCL endpoint lives on CUDA's current device, GPU 0 (the sync sends from the current GPU;
    # a trainer on cuda:N made GPU N current, selfopd.core.devices.use_device).
    nccl_gpus = set(trainer) if trainer else {0}
    what = f"trainer GPUs {sorted(trainer)}" if trainer else "GPU 0 (a CPU trainer's NCCL endpoint is CUDA's current device)"
    warnings = []
    for slot in slots:
        in_nccl = sync == "nccl" and slot.synced
        if in_nccl and not slot.gpus:
            fail(slot.gpu_key, f"not set: with engine.weight_sync = 'nccl' on a GPU machine the {slot.name} server "
                 f"would start on vLLM's default GPUs {list(range(slot.tensor_parallel_size))}, whatever the trainer "
                 f"uses ({what}), and NCCL refuses a trainer rank and a server worker on one GPU; set "
                 f"engine.student_gpus / engine.teacher_gpus to GPUs the trainer does not use, or use "
                 f"engine.kind = 'vllm_colocate' on one GPU")
        placed = slot.gpus or tuple(range(slot.tensor_parallel_size))
        shared = ", ".join(map(str, sorted(set(placed) & (nccl_gpus if in_nccl else set(trainer)))))
        if shared and in_nccl:
            fail(slot.gpu_key, f"GPU {shared} of the {slot.name} server is also used by the trainer ({what}); with "
                 f"engine.weight_sync = 'nccl' the trainer's rank 0 and the server's workers join one NCCL group, "
                 f"which refuses two ranks on one GPU ('Duplicate GPU detected'): give the servers GPUs of their "
                 f"own, or use engine.kind = 'vllm_colocate' on one GPU")
        if shared:
            warnings.append(f"the {slot.name} server shares GPU {shared} with the trainer (not in an NCCL group; "
                            f"its engine.gpu_memory_utilization = {shares[slot.name][0]} of the GPU must be free when "
                            "it starts)")
    return warnings


def _check_memory(slots: Sequence[ServerSlot], shares: dict[str, tuple[float, str]]) -> None:
    """Servers may share a GPU while their memory budgets fit in it together."""
    on_gpu: dict[int, list[ServerSlot]] = defaultdict(list)
    for slot in slots:
        for gpu in slot.gpus or range(slot.tensor_parallel_size):
            on_gpu[gpu].append(slot)
    for gpu, shared in sorted(on_gpu.items()):
        total = sum(shares[slot.name][0] for slot in shared)
        if total > MAX_SERVER_SHARE + 1e-9:
            names = ", ".join(f"{slot.name} on {slot.gpu_key}" if slot.gpus else f"{slot.name} by vLLM's default"
                              for slot in shared)
            each = sorted({shares[slot.name][0] for slot in shared})
            fail("engine.gpu_memory_utilization",
                 f"GPU {gpu} holds {len(shared)} server(s) ({names}) at {' / '.join(map(str, each))} each, "
                 f"{total:.2f} of the GPU, more than {MAX_SERVER_SHARE} (the rest holds the CUDA "
                 f"context, the weight push's receive chunks and the communicator); give them GPUs of their own or "
                 f"lower engine.gpu_memory_utilization to {MAX_SERVER_SHARE / len(shared):.2f} or less")


def _url_warnings(engine: EngineConfig) -> list[str]:
    """GPU and server-count keys that do nothing because those servers are given by URL."""
    warnings = []
    if engine.urls("student_urls"):
        ignored = [f"engine.{key}" for key, unset in (("student_gpus", not engine.student_gpus.strip()),
                                                       ("student_servers", engine.student_servers == 1)) if not unset]
        if ignored:
            warnings.append(f"{' and '.join(ignored)} ignored: the student servers are given by engine.student_urls "
                            "and placed where they run")
    if engine.urls("teacher_url") and engine.teacher_gpus.strip():
        warnings.append("engine.teacher_gpus ignored: the teacher server is given by engine.teacher_url "
                        "and placed where it runs")
    return warnings
