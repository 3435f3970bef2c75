"""The worker protocol's frames: JSON both ways, so a reply is data and never code.

The worker runs scorers on model-written answers; were it ever subverted, a pickled reply would
run its code in the trainer. A frame is a 4-byte big-endian length, then UTF-8 JSON of a tagged
tree: scalars (None, bool, int, float, str) as themselves, a list as {"list": [...]}, a tuple as
{"tuple": [...]}, a dict as {"dict": [[key, value], ...]}. The tags keep what plain JSON loses
in reasoning-gym entries (tuples, whose loss makes arc_agi score its own answer 0.05; int keys,
in graph_color). The reader also checks each reply's shape for its task (`check_reply`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

MAX_FRAME_BYTES = 64 << 20  # an entry or a reply is kilobytes; a bigger length is a broken peer
_CONTAINERS = {"list": list, "tuple": tuple}


class FrameError(ValueError):
    """A frame that is not a well-formed tagged JSON tree of the expected shape."""


def encode(value: Any) -> Any:
    """`value` as a tagged JSON tree; TypeError for anything but the types above."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)  # numpy.str_ (knights_knaves) becomes a plain str
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"the verifier worker takes JSON-like values, not {type(value).__name__}")


def decode(tree: Any) -> Any:
    """The value a tagged tree stands for; FrameError for anything else."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, dict) and len(tree) == 1:
        (tag, items), = tree.items()
        if isinstance(items, list):
            if tag in _CONTAINERS:
                return _CONTAINERS[tag](decode(v) for v in items)
            if tag == "dict" and all(isinstance(p, list) and len(p) == 2 for p in items):
                return {decode(k): decode(v) for k, v in items}
    raise FrameError("not a tagged JSON tree")


def frame_bytes(value: Any) -> bytes:
    payload = json.dumps(encode(value), separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return struct.pack(">I", len(payload)) + payload


def frame_length(header: bytes) -> int:
    length = struct.unpack(">I", header)[0]
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return length


def parse_frame(payload: bytes) -> Any:
    """The value of one frame's payload; FrameError when it is not one (bad UTF-8 or JSON,
    nesting too deep, an unhashable key, an integer too long to read)."""
    try:
        return decode(json.loads(payload.decode()))
    except (ValueError, TypeError, RecursionError) as e:
        raise FrameError(f"malformed frame ({type(e).__name__})") from None


def write_frame(stream: BinaryIO, value: Any) -> None:
    stream.write(frame_bytes(value))
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
    """One value from a blocking stream; None at end of stream."""
    header = _read_exactly(stream, 4)
    payload = None if header is None else _read_exactly(stream, frame_length(header))
    return None if payload is None else parse_frame(payload)


# --- what each worker task may answer -------------------------------------------------------
def _is_score(value: Any) -> bool:
    return type(value) is float and math.isfinite(value) and 0.0 <= value <= 1.0


RESULT_SHAPES: dict[str, Callable[[Any], bool]] = {
    "reasoning_gym_score": _is_score,
    "math_verify": lambda value: type(value) is bool,
    "import_reasoning_gym": lambda value: value is None,
    "sleep": lambda value: value is None,
    "echo": lambda value: True,  # tests: the round trip itself
    "facts": lambda value: isinstance(value, dict),  # tests: what the worker sees of itself
}
_ERROR_NAME_CHARS = 80


def check_reply(task: str, reply: Any) -> tuple[str, Any]:
    """(status, value) of a worker's reply to `task`, or FrameError when its shape is wrong:
    ("ok", a value of the task's shape), ("timeout", None), ("error", an exception's type name),
    ("violation", an audit event's name)."""
    if not (isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[0], str)):
        raise FrameError("a reply is not a (status, value) pair")
    status, value = reply
    if status == "ok" and task in RESULT_SHAPES and RESULT_SHAPES[task](value):
        return status, value
    if status == "timeout" and value is None:
        return status, value
    if status in ("error", "violation") and isinstance(value, str) and len(value) <= _ERROR_NAME_CHARS \
            and value.replace(".", "").replace("_", "").isalnum() and value.isascii():
        return status, value
    raise FrameError(f"a {status!r} reply of the wrong shape for task {task!r}")
