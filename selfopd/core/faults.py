"""Fault injection for the kill-and-resume tests: `fault_point(name)` marks a moment at which
a real `kill -9` is worth testing (mid-sampling, between backward passes, half-way through a
checkpoint, while metrics are written, ...).

    SELFOPD_KILL_AT=checkpoint.weights      # SIGKILL the process the 1st time it gets there
    SELFOPD_KILL_AT=train.backward:3        # ... the 3rd time
    SELFOPD_KILL_SIGNAL=SIGTERM             # send this signal instead (the process goes on to handle it)

Without the variable a point costs one comparison (the variable is read once per process).
The process kills itself with SIGKILL, so nothing runs after: no `finally`, no atexit, no
flush, exactly as when the machine or the OOM killer takes it.

A second fault, for the weight-transfer tests, runs in a vLLM server's workers:

    SELFOPD_DROP_WEIGHTS=model.layers.1.    # the server receives these tensors but never loads them

which is what vLLM's layerwise reload does, with one log line, to a layer that receives nothing:
it keeps the old weights. The digest check after the push must catch it.
"""

from __future__ import annotations

import os
import signal

ENV = "SELFOPD_KILL_AT"
DROP_ENV = "SELFOPD_DROP_WEIGHTS"
_DROPPED = os.environ.get(DROP_ENV, "")


def _parse(value: str) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, count = value.partition(":")
    return name, int(count) if count else 1


_TARGET = _parse(os.environ.get(ENV, ""))
_SIGNAL = signal.Signals[os.environ.get("SELFOPD_KILL_SIGNAL", "SIGKILL")]
_reached: dict[str, int] = {}


def fault_point(name: str) -> None:
    """SIGKILL this process (or send it SELFOPD_KILL_SIGNAL) if `SELFOPD_KILL_AT` names this point and this
    is its N-th visit."""
    if _TARGET is None or _TARGET[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == _TARGET[1]:
        os.kill(os.getpid(), _SIGNAL)


def dropped_weights(name: str) -> bool:
    """Whether a server worker must leave the received tensor `name` unloaded (`SELFOPD_DROP_WEIGHTS`)."""
    return bool(_DROPPED) and name.startswith(_DROPPED)
