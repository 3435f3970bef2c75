"""The worker protocol's JSON frames: every reasoning-gym entry survives the trip exactly, and
anything that is not a well-formed reply of the right shape is refused (never executed)."""

from __future__ import annotations

import io
import json
import pickle
import struct

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from selfopd.verifiers.frames import (MAX_FRAME_BYTES, FrameError, check_reply, frame_bytes, frame_length,
                                      parse_frame, read_frame, write_frame)


def _round_trip(value):
    stream = io.BytesIO()
    write_frame(stream, value)
    stream.seek(0)
    return read_frame(stream)


def _same(a, b) -> bool:
    """Equal, and of the same container types all the way down (a tuple stays a tuple)."""
    if type(a) in (list, tuple) or type(b) in (list, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b and (isinstance(a, str) or type(a) is type(b))


@pytest.mark.parametrize("task", sorted(set(DATASETS) - {"composite"}))  # composite needs sub-datasets
def test_every_reasoning_gym_entry_survives_the_trip(task):
    entry = reasoning_gym.create_dataset(task, size=1, seed=3)[0]
    assert _same(_round_trip(("reasoning_gym_score", (task, "answer", entry), 5.0)),
                 ("reasoning_gym_score", (task, "answer", entry), 5.0))


def test_tuples_int_keys_and_scalars_keep_their_types():
    value = {1: (2, [3.5, None]), "a": [True, "b"], (1, 2): {}}
    assert _same(_round_trip(value), value)
    with pytest.raises(TypeError, match="not set"):
        frame_bytes({1, 2})


@pytest.mark.parametrize("payload", [
    pickle.dumps(("ok", 1.0)),  # the old protocol: never unpickled
    b"\xff\xfe", b"[1, 2", b'{"list": [1], "tuple": []}', b'{"set": [1]}', b'{"dict": [[{"list": []}, 1]]}',
    b'{"dict": [[1]]}', b"[1]", b"9" * 5000, b'{"list": ' * 100_000,
])
def test_malformed_frames_are_refused(payload):
    with pytest.raises(FrameError):
        parse_frame(payload)


def test_oversized_frames_are_refused_both_ways():
    with pytest.raises(FrameError, match="over the"):
        frame_length(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameError, match="over the"):
        frame_bytes("x" * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("task, reply", [
    ("reasoning_gym_score", ("ok", 0.5)), ("reasoning_gym_score", ("ok", 1.0)), ("math_verify", ("ok", False)),
    ("import_reasoning_gym", ("ok", None)), ("echo", ("ok", {"any": ("thing",)})), ("math_verify", ("timeout", None)),
    ("math_verify", ("error", "RecursionError")), ("no_such_task", ("error", "KeyError")),
    ("reasoning_gym_score", ("violation", "os.system")),
])
def test_replies_of_the_right_shape_pass(task, reply):
    assert check_reply(task, reply) == reply


@pytest.mark.parametrize("task, reply", [
    ("reasoning_gym_score", ("ok", 1.5)), ("reasoning_gym_score", ("ok", -0.1)),
    ("reasoning_gym_score", ("ok", float("nan"))), ("reasoning_gym_score", ("ok", "1.0")),
    ("reasoning_gym_score", ("ok", True)), ("reasoning_gym_score", ("ok", 1)), ("math_verify", ("ok", 1)),
    ("math_verify", ("ok", None)), ("import_reasoning_gym", ("ok", 0)), ("no_such_task", ("ok", None)),
    ("math_verify", ("error", "\x1b[2J")), ("math_verify", ("error", "x" * 200)), ("math_verify", ("error", 3)),
    ("math_verify", ("timeout", 1)), ("math_verify", ("maybe", None)), ("math_verify", ["ok", True]),
    ("math_verify", ("ok",)),
])
def test_replies_of_the_wrong_shape_are_refused(task, reply):
    with pytest.raises(FrameError):
        check_reply(task, reply)


def test_frames_are_plain_json():
    assert json.loads(frame_bytes(("ok", (1, "a")))[4:]) == {"tuple": ["ok", {"tuple": [1, "a"]}]}
