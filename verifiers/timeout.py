"""Run a check in a killable worker process, so no answer can hang the caller.

Why not math-verify's own timeout: it is `signal.alarm`, which
  - only works in the main thread of the main interpreter (it raises ValueError in a
    ThreadPoolExecutor worker, where RL reward functions often run),
  - has whole-second resolution, and cancels any SIGALRM timer the caller already had
    (pytest-timeout's signal method, for one),
  - runs its handler only between bytecodes, so one long C-level call finishes first, and
    it does nothing about memory (the worker has an address-space limit).
A separate process can always be killed. Each calling process keeps a small pool of
long-lived workers (`python -m selfopd.verifiers.worker`, started with subprocess, so this also
works inside daemonic multiprocessing workers that may not fork children of their own).
A check that misses its deadline gets its worker SIGKILLed and a fresh one started at once
in the background. The deadline covers the check only, not a worker's start-up (about a
second to import sympy), which has its own generous limit.

Workers handle model-written text, so they get the least they need (see `worker.py`): an
environment of only what Python needs (none of the caller's keys or tokens), an empty private
folder as working directory, stderr through a pipe we drain (a worker may not write files, and
the caller's stderr may be one). Their replies are JSON frames checked for shape (`frames.py`).

Isolation mode (`set_isolation`, or the environment variable SELFOPD_VERIFIER_ISOLATION):
  - "sandbox" (the default): the worker runs in a bubblewrap sandbox (`isolation.py`: no
    network, no view of our files, processes or environment, an unprivileged uid, a process
    limit), its audit hook a second wall inside. When no sandbox can start here (bwrap missing,
    user namespaces refused), every worker start raises a WorkerError that says why and how
    to fix it; nothing falls back to weaker isolation silently.
  - "limits": the worker runs as a plain child process with only its own rlimits and audit hook,
    for machines where bubblewrap cannot run (some HPC clusters, unprivileged containers).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import isolation
from .frames import FrameError, check_reply, frame_bytes, frame_length, parse_frame

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # math-verify's own default; plain-number answers never get here
STARTUP_TIMEOUT_S = 120.0  # importing sympy on a busy 2-core machine can take many seconds
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))  # more concurrent callers wait their turn
# All a worker inherits from the caller's environment: what Python and its libraries read.
WORKER_ENV_KEYS = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH",
                   "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_STDERR_LINES = 20  # the tail of a worker's stderr that a WorkerError quotes
_STDERR_LINE_BYTES = 4096  # a line longer than this is read in pieces: our memory stays bounded
ISOLATION_ENV = "SELFOPD_VERIFIER_ISOLATION"
ISOLATION_MODES = ("sandbox", "limits")
# A worker runs many checks, so no CPU-seconds limit: the per-check deadline bounds its time.
# 32 tasks (threads included) is several times what it uses; a fork bomb stops there.
# Memory as the worker limits itself (worker.MEMORY_LIMIT_BYTES, not imported: its tasks import this module).
WORKER_LIMITS = isolation.Limits(memory_bytes=4 << 30, file_bytes=0, processes=32)
_isolation: str | None = None


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: the keys above, and our package on its path."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    env = {key: os.environ[key] for key in WORKER_ENV_KEYS if key in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # it may not write files
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(key, "1")  # one check at a time: no thread per core (they count as processes)
    return env


def set_isolation(mode: str | None) -> None:
    """Choose how workers started from now on are isolated ("sandbox" or "limits", see above);
    None goes back to the environment variable (or the default, "sandbox")."""
    global _isolation
    if mode is not None and mode not in ISOLATION_MODES:
        raise ValueError(f"verifier isolation must be one of {ISOLATION_MODES}, got {mode!r}")
    _isolation = mode


def isolation_mode() -> str:
    """The mode set by `set_isolation`, else $SELFOPD_VERIFIER_ISOLATION, else "sandbox"."""
    if _isolation is not None:
        return _isolation
    mode = os.environ.get(ISOLATION_ENV, "").strip() or "sandbox"
    if mode not in ISOLATION_MODES:
        raise ValueError(f"{ISOLATION_ENV}={mode!r} is not one of {', '.join(ISOLATION_MODES)}")
    return mode


def check_isolation() -> None:
    """Raise the WorkerError a worker start would raise, now: for a run's checks before it starts
    (a verifier that cannot start scores every answer as unchecked)."""
    if isolation_mode() == "sandbox":
        reason = isolation.unavailable_reason()
        if reason is not None:
            raise WorkerError(f"the verifier sandbox cannot start: {reason}; install bubblewrap "
                              f"(apt install bubblewrap) or allow unprivileged user namespaces, or accept "
                              f"the weaker audit-hook-only worker with {ISOLATION_ENV}=limits")


def _package_paths() -> list[Path]:
    """What `python -m selfopd.verifiers.worker` imports of ours: this folder, and selfopd's
    __init__.py (its parent package; from a checkout that is selfopd/ beside verifiers/)."""
    here = Path(__file__).resolve().parent
    top = sys.modules.get("selfopd")
    init = Path(top.__file__) if top is not None and top.__file__ else here.parent / "selfopd" / "__init__.py"
    return [here, init] if init.exists() else [here]


def worker_sandbox_command(argv: list[str], folder: Path) -> list[str]:
    """`argv` in the sandbox a worker runs in: its limits, our package and Python read-only,
    `folder` as its scratch (matplotlib's config folder there: reasoning-gym imports it)."""
    env = {**worker_environment(), "MPLCONFIGDIR": f"{isolation.SCRATCH}/matplotlib"}
    return isolation.sandbox_command(argv, folder, limits=WORKER_LIMITS, read_only=_package_paths(), env=env)


class CheckTimeout(Exception):
    """A check did not finish within its time limit; its worker was killed."""


class WorkerError(RuntimeError):
    """The worker could not start, died, or the task raised (the message names the type)."""


class _Worker:
    """One child process and its pipes. Used by one thread at a time (the pool sees to it)."""

    def __init__(self) -> None:
        self.sandboxed = isolation_mode() == "sandbox"
        if self.sandboxed:
            check_isolation()
        self.folder = tempfile.mkdtemp(prefix="selfopd-verifier-")
        command = [sys.executable, "-m", "selfopd.verifiers.worker"]
        try:
            if self.sandboxed:
                command = worker_sandbox_command(command, Path(self.folder))
            self.proc = isolation.popen(  # from a long-lived thread: see isolation.popen
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=worker_environment(),
                cwd=self.folder,
                start_new_session=True,  # a Ctrl-C in the terminal is for the parent, not us
            )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.ready = False
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self.drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self.drain.start()

    def _drain_stderr(self) -> None:
        """Keep the worker's stderr flowing; its lines go to our log (debug) and a short tail."""
        stderr = self.proc.stderr
        assert stderr is not None
        for raw in iter(lambda: stderr.readline(_STDERR_LINE_BYTES), b""):
            line = raw.decode(errors="replace").rstrip()
            self.stderr_tail.append(line)
            logger.debug("verifier worker %d: %s", self.proc.pid, line)

    def gone(self) -> WorkerError:
        """The error for a worker that closed its stdout (exiting), with the last line it wrote."""
        try:
            code: int | None = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        self.drain.join(timeout=1)
        last = next((line for line in reversed(self.stderr_tail) if line.strip()), None)
        return WorkerError(f"worker {self.proc.pid} exited (code {code})" + (f": {last[:200]}" if last else ""))

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        """n bytes from the worker, or CheckTimeout at the deadline (poll: no fd limit)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        data = b""
        while len(data) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise CheckTimeout(f"no reply within the time limit from worker {self.proc.pid}")
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise self.gone()
            data += chunk
        return data

    def _read_frame(self, deadline: float, task: str | None = None) -> Any:
        """One frame from the worker (for `task`: its checked (status, value) reply). A malformed
        one kills the worker: whatever sent it is not behaving as our worker does."""
        try:
            header = self._read_exactly(4, deadline)
            value = parse_frame(self._read_exactly(frame_length(header), deadline))
            return value if task is None else check_reply(task, value)
        except FrameError as e:
            self.kill()
            raise WorkerError(f"worker {self.proc.pid} sent {e}; it was stopped") from None

    def wait_ready(self) -> None:
        if not self.ready:
            try:
                hello = self._read_frame(time.monotonic() + STARTUP_TIMEOUT_S)
            except CheckTimeout as e:
                raise WorkerError(f"worker did not start within {STARTUP_TIMEOUT_S} s") from e
            # A sandboxed worker knows only its pid in its own pid namespace.
            shaped = isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "ready" and type(hello[1]) is int
            if not shaped or not (self.sandboxed or hello[1] == self.proc.pid):
                self.kill()
                raise WorkerError(f"worker {self.proc.pid} did not introduce itself; it was stopped")
            self.ready = True

    def call(self, task: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        self.wait_ready()
        assert self.proc.stdin is not None
        # The worker's own alarm fires well after our deadline: it only matters if we die.
        request = frame_bytes((task, args, 2 * timeout_s + 5))
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"worker {self.proc.pid} is gone") from e
        status, value = self._read_frame(time.monotonic() + timeout_s, task)
        if status == "ok":
            return value
        if status == "timeout":
            raise CheckTimeout("the worker's own backstop alarm fired")
        if status == "violation":
            self.kill()
            raise WorkerError(f"task {task!r} tried {value!r} in worker {self.proc.pid}, which was stopped")
        raise WorkerError(f"task {task!r} raised {value}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL its whole session (anything it started, should it manage to), then tidy up."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        """Ask politely (EOF on stdin ends the worker's loop), then make sure."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class _Pool:
    """Up to MAX_WORKERS workers shared by the threads of one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.idle: list[_Worker] = []
        self.count = 0

    def _acquire(self) -> _Worker:
        with self.cond:
            while not self.idle and self.count >= MAX_WORKERS:
                self.cond.wait()
            if self.idle:
                return self.idle.pop()
            self.count += 1
        try:
            return _Worker()
        except BaseException:
            with self.cond:
                self.count -= 1
                self.cond.notify()
            raise

    def _release(self, worker: _Worker, healthy: bool) -> None:
        replacement = None
        if not healthy:
            worker.kill()
            try:
                replacement = _Worker()  # starts importing now, in the background
            except (OSError, WorkerError):
                replacement = None
        with self.cond:
            if healthy:
                self.idle.append(worker)
            elif replacement is not None:
                self.idle.append(replacement)
            else:
                self.count -= 1
            self.cond.notify()

    def call(self, task: str, args: tuple[Any, ...], timeout_s: float, setup: str | None) -> Any:
        worker = self._acquire()
        healthy = False
        try:
            if setup is not None:
                worker.call(setup, (), STARTUP_TIMEOUT_S)
            value = worker.call(task, args, timeout_s)
            healthy = True
            return value
        except WorkerError:
            healthy = worker.alive() and worker.ready  # a task that raised leaves it usable
            raise
        finally:
            self._release(worker, healthy)

    def close(self) -> None:
        with self.cond:
            workers, self.idle = self.idle, []
            self.count -= len(workers)
        for w in workers:
            w.close()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    """This process's pool; a forked child gets a new one (the parent's pipes are not its own)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
        return _pool


def run_in_worker(task: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, setup: str | None = None) -> Any:
    """Run the worker task `task(*args)` and return its result within `timeout_s` seconds.

    `setup` names a task to run first on the same worker under the start-up limit, for slow
    one-time work such as an import that should not eat into the check's time limit.

    Raises CheckTimeout when the deadline passes (the worker is killed and replaced), and
    WorkerError when the task raised or the worker could not run (no sandbox: see the module notes). Tasks are listed in
    `worker._tasks()`; arguments and results travel as JSON-like values (`frames.py`).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return _get_pool().call(task, args, timeout_s, setup)


def shutdown_workers() -> None:
    """Stop this process's idle workers (they also exit on their own when we exit)."""
    with _pool_lock:
        pool = _pool
    if pool is not None and pool.pid == os.getpid():
        pool.close()


atexit.register(shutdown_workers)
