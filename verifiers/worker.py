"""The child process that runs checks which may hang: `python -m selfopd.verifiers.worker`.

The parent (`timeout.py`) sends (task, args, backstop_s) frames on stdin and kills this
process when a reply is late, so nothing here has to be interruptible. The backstop alarm
only ends a computation whose parent is gone (it died while waiting on us), so no orphan
keeps a core busy for hours. Frames are a 4-byte big-endian length, then a pickle.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

MEMORY_LIMIT_BYTES = 4 << 30  # a runaway sympy computation hits MemoryError, not the OOM killer


def write_frame(stream: BinaryIO, obj: Any) -> None:
    """Send one pickled object, length-prefixed."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">I", len(payload)) + payload)
    stream.flush()


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(stream: BinaryIO) -> Any | None:
    """Receive one object; None when the parent has closed the pipe."""
    header = _read_exactly(stream, 4)
    if header is None:
        return None
    payload = _read_exactly(stream, struct.unpack(">I", header)[0])
    return None if payload is None else pickle.loads(payload)


class _Backstop(BaseException):
    """Raised by the alarm; a BaseException so sympy's `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Backstop()


def _echo(value: Any) -> Any:
    """Return the argument (tests use it to check the round trip)."""
    return value


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
    }


def main() -> None:
    # Replies go on a private copy of stdout; stray prints from libraries go to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning
    import math_verify  # noqa: F401  (import before "ready", so the first check is not slowed)

    tasks = _tasks()
    signal.signal(signal.SIGALRM, _on_alarm)
    write_frame(replies, ("ready", os.getpid()))
    while True:
        request = read_frame(requests)
        if request is None:
            return  # parent closed the pipe (exited or shut us down)
        task, args, backstop_s = request
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
        write_frame(replies, reply)


if __name__ == "__main__":
    main()
