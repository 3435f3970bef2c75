"""The child process that runs checks which may hang: `python -m selfopd.verifiers.worker`.

The parent (`timeout.py`) sends [task, args, backstop_s] frames on stdin and kills this
process when a reply is late, so nothing here has to be interruptible. The backstop alarm
only ends a computation whose parent is gone (it died while waiting on us), so no orphan
keeps a core busy for hours. Frames are JSON (`frames.py`): a reply is data, never code.

It runs with the least it needs, since it handles model-written text: the parent starts it
with a minimal environment (no keys or tokens) in an empty folder; here it limits its memory,
forbids itself to write files (RLIMIT_FSIZE 0) or dump core, and installs an audit hook that
refuses to start processes, open sockets, load native code or signal other processes, and
(outside the parent's setup tasks) to open files for writing, remove, rename or create them.
Tripping the hook ends the worker after its reply ("violation"): code ran that should not
have, and the worker may no longer be trusted.
The hook and limits are the inner walls, behind the answer grammars (`task_grammars.py`); the
OS boundary is the bubblewrap sandbox the parent starts this process in (`isolation.py`,
unless the caller chose the "limits" mode: see `timeout.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .frames import read_frame, write_frame

MEMORY_LIMIT_BYTES = 4 << 30  # a runaway sympy computation hits MemoryError, not the OOM killer
# What a scorer never does: start processes, use the network, load native code, signal others.
BLOCKED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn",
    "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "webbrowser.open",
})
# Changes to files: refused too, except during a setup task the parent asks for (importing
# reasoning-gym makes matplotlib create its config folders; no answer is involved then).
FILE_EVENTS = frozenset({
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate", "os.chmod",
    "os.chown", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copytree", "shutil.move",
})
SETUP_TASKS = frozenset({"import_reasoning_gym"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_violations: list[str] = []
_in_setup = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Refuse what a scorer never does (see above); remember that it was tried. In a setup task
    (no answer involved) a refusal is not a violation: importing reasoning-gym makes matplotlib,
    with no font cache it can write, ask `fc-list` for fonts; refused, it reads the font folders."""
    writes = event in FILE_EVENTS or (event == "open" and len(args) > 2 and isinstance(args[2], int)
                                      and args[2] & _WRITE_FLAGS)
    if event in BLOCKED_EVENTS or (writes and not _in_setup[0]):
        if not _in_setup[0]:
            _violations.append(event)
        raise PermissionError(f"the verifier worker may not {event}")


def _limit(kind: int, value: int) -> None:
    """Soft and hard limit `value` (or the hard limit we were given, when lower)."""
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass


class _Backstop(BaseException):
    """Raised by the alarm; a BaseException so sympy's `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Backstop()


def _echo(value: Any) -> Any:
    """Return the argument (tests use it to check the round trip)."""
    return value


def _facts() -> dict[str, Any]:
    """What this process sees of itself: tests check the sandbox from inside the real worker."""
    with open("/proc/net/dev") as f:
        interfaces = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
    kinds = ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup")
    names = ("RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_CORE", "RLIMIT_NOFILE")
    return {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(), "cwd": os.getcwd(),
            "cwd_entries": sorted(os.listdir(".")), "root_entries": sorted(os.listdir("/")),
            "environ": dict(os.environ), "interfaces": interfaces,
            "namespaces": {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in kinds},
            "limits": {name: list(resource.getrlimit(getattr(resource, name))) for name in names}}


def _tasks() -> dict[str, Callable[..., Any]]:
    """What the parent may ask for, by name (nothing arbitrary is ever executed)."""
    from .equivalence import math_verify_equivalent
    from .reasoning_gym_adapter import import_reasoning_gym, score_in_worker

    return {
        "math_verify": math_verify_equivalent,
        "reasoning_gym_score": score_in_worker,
        "import_reasoning_gym": import_reasoning_gym,
        "echo": _echo,
        "sleep": time.sleep,  # tests use it to exercise the kill path
        "facts": _facts,  # tests: what the worker's own process sees
    }


def main() -> None:
    # Replies go on a private copy of stdout; stray prints from libraries go to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    _limit(resource.RLIMIT_AS, MEMORY_LIMIT_BYTES)
    _limit(resource.RLIMIT_FSIZE, 0)  # Python ignores SIGXFSZ: a write fails with EFBIG instead
    _limit(resource.RLIMIT_CORE, 0)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning
    # Imported before "ready" (the first check is not slowed) and before the audit hook: sympy loads ctypes,
    # which reasoning-gym's scorers need too. Without math-verify the parent never asks for it
    # (`equivalence.math_verify_installed`), so sympy alone is imported.
    try:
        import math_verify  # noqa: F401
    except ImportError:
        with contextlib.suppress(ImportError):
            import sympy  # noqa: F401

    tasks = _tasks()
    signal.signal(signal.SIGALRM, _on_alarm)
    sys.addaudithook(_audit)
    write_frame(replies, ("ready", os.getpid()))
    while True:
        request = read_frame(requests)
        if request is None:
            return  # parent closed the pipe (exited or shut us down)
        task, args, backstop_s = request
        _in_setup[0] = task in SETUP_TASKS
        try:
            signal.setitimer(signal.ITIMER_REAL, backstop_s)
            try:
                value = tasks[task](*args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            reply = ("ok", value)
        except _Backstop:
            reply = ("timeout", None)
        except Exception as e:  # noqa: BLE001  # report, never die: the parent decides
            # Only the type: str() of a sympy object can itself hang.
            reply = ("error", type(e).__name__)
        if _violations:
            reply = ("violation", _violations[0])
        write_frame(replies, reply)
        if _violations:
            os._exit(3)


if __name__ == "__main__":
    main()
