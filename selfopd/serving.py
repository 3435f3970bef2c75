"""From a training config to vLLM servers and the engines that talk to them.

Which servers a run needs: one (or several, given as URLs) for the student, and one for
the teacher: a second instance of the student's weights for a `self` teacher (synced
with the student after every step), the initial student for `frozen`, the teacher model
for `external`. Servers given as URLs are used as they are; the others are launched here
and stopped when the run's `ExitStack` closes.
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path

from selfopd.config import TrainConfig
from selfopd.engines.vllm import VLLMEngine
from selfopd.engines.vllm_server import ServerSpec, cuda_available, launch_servers
from selfopd.engines.weight_sync import FileWeightSync, NCCLWeightSync, ServerControl, WeightSync
from selfopd.models import resolve_model

NCCL_FIRST_PORT = 29600


def weight_sync_kind(config: TrainConfig) -> str:
    """'file' or 'nccl': what engine.weight_sync = 'auto' means on this machine."""
    if config.engine.weight_sync != "auto":
        return config.engine.weight_sync
    return "nccl" if cuda_available() else "file"


def model_folders(config: TrainConfig) -> tuple[str, str]:
    """(student folder, teacher folder) that launched servers load."""
    student = str(resolve_model(config.model.student))
    teacher = str(resolve_model(config.teacher.weights(config.model.student)))
    return student, teacher


def planned_servers(config: TrainConfig) -> list[ServerSpec]:
    """The servers selfopd must launch for `config`: those not given as URLs."""
    engine = config.engine
    student_dir, teacher_dir = model_folders(config)
    common = dict(
        host=engine.host, dtype=config.model.dtype, max_model_len=engine.max_model_len,
        eager=not (engine.compile == "on" or (engine.compile == "auto" and cuda_available())),
        weight_transfer=weight_sync_kind(config), gpu_memory_utilization=engine.gpu_memory_utilization,
        cpu_kv_cache_gb=engine.cpu_kv_cache_gb, extra_args=tuple(shlex.split(engine.extra_server_args)),
    )
    specs = []
    if not engine.urls("student_urls"):
        specs.append(ServerSpec(name="student", model=student_dir, port=engine.port, prefix_caching=False, **common))
    if not engine.urls("teacher_url"):
        specs.append(ServerSpec(name="teacher", model=teacher_dir, port=engine.port + 1, prefix_caching=True, **common))
    return specs


def open_vllm_engines(config: TrainConfig, log_dir: Path, stack: contextlib.ExitStack,
                      progress: bool = True) -> tuple[VLLMEngine, VLLMEngine]:
    """(student engine, teacher engine), launching missing servers; `stack` closes them all."""
    specs = planned_servers(config)
    launched = {}
    if specs:
        servers = stack.enter_context(launch_servers(specs, log_dir, config.engine.startup_timeout_s, progress))
        launched = {server.spec.name: server.spec.url for server in servers}
    student_urls = config.engine.urls("student_urls") or [launched["student"]]
    teacher_urls = config.engine.urls("teacher_url") or [launched["teacher"]]
    kind = weight_sync_kind(config)
    options = dict(max_concurrency=config.engine.max_concurrency, timeout_s=config.engine.request_timeout_s,
                   retries=config.engine.retries)
    student = VLLMEngine(student_urls, weight_sync=_weight_sync(kind, student_urls, NCCL_FIRST_PORT, config), **options)
    stack.callback(student.close)
    teacher_sync = (_weight_sync(kind, teacher_urls, NCCL_FIRST_PORT + len(student_urls), config)
                    if config.teacher.follows_student else None)
    teacher = VLLMEngine(teacher_urls, weight_sync=teacher_sync, **options)
    stack.callback(teacher.close)
    return student, teacher


def _weight_sync(kind: str, urls: list[str], first_port: int, config: TrainConfig) -> WeightSync:
    controls = [ServerControl(url, config.engine.request_timeout_s) for url in urls]
    if kind == "nccl":
        return NCCLWeightSync(controls, master_address=config.engine.trainer_address, first_port=first_port)
    return FileWeightSync(controls)
