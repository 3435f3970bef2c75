"""From a training config's sections (`ServingSettings`) to vLLM servers and the engines that talk to them.

Which servers a run needs: `engine.student_servers` for the student (or several given as
URLs), and one for the teacher: a second instance of the student's weights for a `self`
teacher (synced with the student after every step), the initial student for `frozen`,
the teacher model for `external`. Servers given as URLs are used as they are; the others
are placed on their GPUs (`selfopd.serving.gpu_layout`, checked before any starts), launched
here and stopped when the run's `ExitStack` closes. `selfopd eval` opens the student's servers alone
through the same code (`open_student_engine`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

from selfopd.config import ConfigError, EngineConfig, ModelConfig, TeacherConfig
from selfopd.config.bundles import ServingSettings
from selfopd.core.distributed import World, all_gather
from selfopd.serving.vllm import VLLMEngine
from selfopd.serving.server import (ServerError, ServerSpec, cuda_available, launch_servers, launched_key,
                                    visible_devices)
from selfopd.serving.server_auth import new_key
from selfopd.serving.server_control import CONTROL_TIMEOUT_S
from selfopd.serving.weight_sync import ServerControl, WeightTransfer
from selfopd.serving.gpu_layout import (GPULayout, check_layout, resolved_sync, server_role, server_shares, server_slots,
                                        single_process_trainer_gpus)
from selfopd.core.models import resolve_model

SERVE_KEY_ENV = "SELFOPD_VLLM_API_KEY"  # where `selfopd serve` tells a later `selfopd train` to put a generated key

def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if cuda_available() else 0


def weight_sync_kind(engine: EngineConfig) -> str:
    """'gloo' or 'nccl': the collective of the weight push (engine.weight_sync; 'auto': nccl with CUDA)."""
    return resolved_sync(engine, gpu_count())


def model_folders(model: ModelConfig, teacher: TeacherConfig) -> tuple[str, str]:
    """(student folder, teacher folder) that launched servers load."""
    student = str(resolve_model(model.student, model.revision))
    teacher_dir = str(resolve_model(teacher.weights(model.student), teacher.weights_revision(model.revision)))
    return student, teacher_dir


def planned_servers(settings: ServingSettings, layout: GPULayout | None = None) -> list[ServerSpec]:
    """The servers selfopd must launch for `settings` (those not given as URLs), students first.

    Each is pinned to its GPUs (`selfopd.serving.gpu_layout.server_slots`) through
    CUDA_VISIBLE_DEVICES and runs with its tensor-parallel size and its memory share in
    `layout` (default: this machine's, with no trainer on it, as `selfopd serve` runs)."""
    engine, model = settings.engine, settings.model
    student_dir, teacher_dir = model_folders(model, settings.teacher)
    slots = server_slots(engine, settings.teacher)
    shares = layout.shares if layout else server_shares(slots, (), gpu_count(), engine.gpu_memory_utilization)
    on_gpu = cuda_available()
    common = dict(
        host=engine.host, dtype=model.dtype, max_model_len=engine.max_model_len,
        eager=not (engine.compile == "on" or (engine.compile == "auto" and on_gpu)),
        gpu=on_gpu,
        max_logprobs=max(ServerSpec.max_logprobs, settings.top_k),
        cpu_kv_cache_gb=engine.cpu_kv_cache_gb, extra_args=tuple(shlex.split(engine.extra_server_args)),
        trust_remote_code=model.trust_remote_code, api_key=engine.launch_key(),
        trainer_address=engine.trainer_address,
    )
    return [ServerSpec(name=slot.name, model=teacher_dir if slot.role == "teacher" else student_dir, port=slot.port,
                       tensor_parallel_size=slot.tensor_parallel_size, gpu_memory_utilization=shares[slot.name][0],
                       env=visible_devices(slot.gpus), **common)
            for slot in slots]


@dataclass(frozen=True)
class SyncTarget:
    """One server the weight push reaches, and its GPUs (() when unknown: a CPU server, one given by URL)."""

    role: str  # "student" or "teacher"
    url: str
    gpus: tuple[int, ...] = ()


def transfer_groups(targets: Sequence[SyncTarget], backend: str) -> list[list[SyncTarget]]:
    """The groups of one push: all servers in one on a CPU (gloo); with NCCL, which refuses a GPU twice in
    a communicator, servers that share a GPU go to different groups (first fit, in order)."""
    groups: list[list[SyncTarget]] = []
    for target in targets:
        for group in groups if backend == "nccl" else groups[:1]:
            if backend != "nccl" or not set(target.gpus) & {gpu for other in group for gpu in other.gpus}:
                group.append(target)
                break
        else:
            groups.append([target])
    return groups


def weight_sync_plan(engine: EngineConfig, teacher: TeacherConfig, student_urls: Sequence[str],
                     teacher_urls: Sequence[str]) -> dict[str, list[list[SyncTarget]]]:
    """Who is sent what: "student": the groups of every student server and a `self` teacher's server
    (the student's weights, one push); "ema": an `ema` teacher's server (the average, a push of its
    own). A frozen or external teacher keeps its weights. Launched servers carry their GPUs."""
    placed = {slot.port: slot.gpus for slot in server_slots(engine, teacher)}
    host = ServerSpec(name="", model="", port=0, host=engine.host).connect_host

    def target(role: str, url: str) -> SyncTarget:
        launched = [gpus for port, gpus in placed.items() if url == f"http://{host}:{port}"]
        return SyncTarget(role, url, launched[0] if launched else ())

    backend = weight_sync_kind(engine)
    students = [target("student", url) for url in student_urls]
    teachers = [target("teacher", url) for url in teacher_urls]
    plan = {"student": transfer_groups(students + (teachers if teacher.follows_student else []), backend)}
    if teacher.kind == "ema":
        plan["ema"] = transfer_groups(teachers, backend)
    return plan


def open_weight_transfers(settings: ServingSettings, student_urls: Sequence[str],
                          teacher_urls: Sequence[str]) -> tuple[WeightTransfer, WeightTransfer | None]:
    """(the transfer of the student's weights, the teacher engine's transfer or None): one object for
    the student servers and a `self` teacher's (one broadcast reaches them all), another for an `ema`
    teacher. The calling process becomes rank 0 of every group, on its current CUDA device with NCCL:
    under torchrun call it on trainer rank 0 only (other ranks open their engines with `weight_sync=False`)."""
    engine, teacher = settings.engine, settings.teacher
    plan = weight_sync_plan(engine, teacher, student_urls, teacher_urls)
    port = engine.sync_port
    transfers: dict[str, WeightTransfer] = {}
    for role, groups in plan.items():
        controls = [[ServerControl(target.url, engine.request_timeout_s or CONTROL_TIMEOUT_S, engine.api_key())
                     for target in group]
                    for group in groups]
        transfers[role] = WeightTransfer(controls, backend=weight_sync_kind(engine), host=engine.trainer_address,
                                         port=port, timeout_s=engine.sync_timeout_s, buffer_mb=engine.sync_buffer_mb,
                                         keep_requests=role == "student" and settings.in_flight,
                                         verify_every=engine.verify_every)
        port = port + len(groups) if port else 0
    student = transfers["student"]
    return student, (student if teacher.follows_student else transfers.get("ema"))


def run_layout(settings: ServingSettings, trainer_gpus: Sequence[int] | None = None) -> GPULayout:
    """The checked GPU layout of a training run on this machine (ConfigError if refused).

    `trainer_gpus`: the GPUs of this node's trainer ranks (the distributed trainer passes
    them); default: model.device's GPU for one process, [] on CPU."""
    count = gpu_count()
    if trainer_gpus is None:
        trainer_gpus = single_process_trainer_gpus(settings.model.device, count)
    return check_layout(settings.engine, settings.teacher, trainer_gpus, count)


def log_layout(layout: GPULayout, log_dir: Path, progress: bool) -> None:
    """The layout table into the run's logs (gpu_layout.txt) and, with progress on, to stderr."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "gpu_layout.txt").write_text(layout.table() + "\n")
    if progress or layout.warnings:
        print(f"selfopd: {layout.table()}", file=sys.stderr, flush=True)


def open_vllm_engines(settings: ServingSettings, log_dir: Path, stack: contextlib.ExitStack, progress: bool = True,
                      trainer_gpus: Sequence[int] | None = None,
                      weight_sync: bool = True) -> tuple[VLLMEngine, VLLMEngine | None]:
    """(student engine, teacher engine), launching missing servers; `stack` closes them all. The
    teacher engine is None with engine.teacher_engine = 'local' (the trainer scores it).

    The GPU layout is checked first, before any server starts (`run_layout`; build_run
    checks it before the model loads, too). `weight_sync=False` opens the engines without a
    sync (torchrun ranks other than 0; see `open_weight_transfers`)."""
    engine = settings.engine
    layout = run_layout(settings, trainer_gpus)
    log_layout(layout, log_dir, progress)
    launched = launch(planned_servers(settings, layout), engine, log_dir, stack, progress)
    student_urls = engine.urls("student_urls") or [s.url for s in launched if server_role(s.name) == "student"]
    teacher_urls = engine.urls("teacher_url") or [s.url for s in launched if server_role(s.name) == "teacher"]
    student_sync, teacher_sync = (open_weight_transfers(settings, student_urls, teacher_urls) if weight_sync
                                  else (None, None))
    return client_engines(engine, student_urls, teacher_urls, stack, student_sync, teacher_sync)


def open_student_engine(settings: ServingSettings, folder: str, log_dir: Path, stack: contextlib.ExitStack,
                        urls: Sequence[str] = (), progress: bool = True) -> VLLMEngine:
    """The student's engine alone, for sampling (`selfopd eval`): over `urls` (running servers) when given,
    else over the student servers `settings` plan (same dtype, context, GPUs, key), each serving `folder`,
    launched here with no weight sync and stopped when `stack` closes."""
    if not urls:
        specs = [replace(spec, model=folder) for spec in planned_servers(settings) if server_role(spec.name) == "student"]
        if not specs:
            raise ConfigError("engine.student_urls", "is set, so no student server is launched: pass --server URL to "
                              "evaluate on a running server, or unset engine.student_urls")
        urls = [spec.url for spec in launch(specs, settings.engine, log_dir, stack, progress)]
    return client_engines(settings.engine, urls, [], stack)[0]


def launch(specs: Sequence[ServerSpec], engine: EngineConfig, log_dir: Path, stack: contextlib.ExitStack,
           progress: bool = True) -> list[ServerSpec]:
    """`specs` started and ready (none: nothing to start), stopped when `stack` closes; the specs as launched."""
    if not specs:
        return []
    servers = stack.enter_context(launch_servers(specs, log_dir, engine.startup_timeout_s, progress))
    return [server.spec for server in servers]


def client_engines(engine: EngineConfig, student_urls: Sequence[str], teacher_urls: Sequence[str],
                   stack: contextlib.ExitStack, student_sync: WeightTransfer | None = None,
                   teacher_sync: WeightTransfer | None = None,
                   api_key: str | None = None) -> tuple[VLLMEngine, VLLMEngine | None]:
    """(student engine, teacher engine or None without teacher servers) over running servers; `stack`
    closes the clients. The key: `api_key`, else engine.api_key_env's, else that of each server this
    process launched."""
    options = dict(max_concurrency=engine.max_concurrency, timeout_s=engine.request_timeout_s,
                   retries=engine.retries, api_key=api_key or engine.api_key())
    student = VLLMEngine(student_urls, weight_sync=student_sync, **options)
    stack.callback(student.close)
    if not teacher_urls:
        return student, None
    teacher = VLLMEngine(teacher_urls, weight_sync=teacher_sync, **options)
    stack.callback(teacher.close)
    return student, teacher


@contextlib.contextmanager
def serve_key(engine: EngineConfig, log_dir: Path) -> Iterator[tuple[str, str]]:
    """For `selfopd serve`: (the key its servers require, the command that trains against them).
    engine.api_key_env's key; without one, a new key in LOG_DIR/api_key, readable by its owner only,
    never printed, deleted when the servers stop."""
    if engine.api_key_env:
        yield engine.launch_key(), f"selfopd train CONFIG --set engine.api_key_env={engine.api_key_env}"
        return
    key, path = new_key(), log_dir / "api_key"
    log_dir.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a file or link left there is not written through
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as file:
        file.write(key + "\n")
    try:
        yield key, (f'{SERVE_KEY_ENV}="$(cat {shlex.quote(str(path))})" selfopd train CONFIG '
                    f"--set engine.api_key_env={SERVE_KEY_ENV}")
    finally:
        path.unlink(missing_ok=True)


def node_trainer_gpus(world: World) -> list[int] | None:
    """The GPUs of this node's trainer ranks under torchrun (rank i on GPU LOCAL_RANK i);
    None for one process (`run_layout` then reads model.device)."""
    if not world.distributed:
        return None
    return list(range(int(os.environ.get("LOCAL_WORLD_SIZE", world.size)))) if gpu_count() else []


def open_vllm_engines_on_ranks(settings: ServingSettings, log_dir: Path, stack: contextlib.ExitStack,
                               world: World, progress: bool = True) -> tuple[VLLMEngine, VLLMEngine | None]:
    """Under torchrun: rank 0 checks the layout (this node's trainer GPUs: one per local
    rank), launches the missing servers and holds the weight syncs; every other rank opens
    clients of the same servers, whose URLs (and the key of the servers it launched) rank 0
    sends over the trainers' own group. Servers launched here listen on rank 0's node
    (engine.host); trainers on several nodes use servers given by URL."""
    trainer_gpus = node_trainer_gpus(world)
    opened, error = None, None
    if world.is_main:
        try:
            opened = open_vllm_engines(settings, log_dir, stack, progress, trainer_gpus=trainer_gpus)
        except BaseException as exc:  # the other ranks must hear of it, not wait forever
            error = exc
    sent = None
    if opened is not None:
        students, teachers = opened[0].urls, opened[1].urls if opened[1] else []
        sent = (students, teachers, next((key for url in students + teachers if (key := launched_key(url))), None))
    urls = all_gather(sent, world)[0]
    if error is not None:
        raise error
    if urls is None:
        raise ServerError("rank 0 could not start or reach the vLLM servers (its own error says why)")
    return opened if opened is not None else client_engines(settings.engine, urls[0], urls[1], stack, api_key=urls[2])
