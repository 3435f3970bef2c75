"""The verifier worker runs with the least it needs, and the parent trusts none of its replies.

The payloads here are sent to the worker's scorer task directly, past the answer grammars, as
code would run if a grammar ever had a hole: what can that code still do?
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import reasoning_gym

import selfopd.verifiers.timeout as timeout
from selfopd.verifiers import WorkerError, run_in_worker, shutdown_workers, verify_reasoning_gym
from selfopd.verifiers.timeout import WORKER_ENV_KEYS
from selfopd.verifiers.worker import MEMORY_LIMIT_BYTES

SECRETS = {"HF_TOKEN": "hf_secret", "WANDB_API_KEY": "wandb-secret", "OPENAI_API_KEY": "sk-secret",
           "SELFOPD_TEST_SECRET": "s3cret"}


@pytest.fixture
def own_pool(monkeypatch):
    """Workers of this test's own, started under its environment, stopped after it."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(timeout, "_pool", None)
    yield
    shutdown_workers()


def _worker_pid() -> int:
    run_in_worker("echo", None, timeout_s=60)
    return timeout._get_pool().idle[-1].proc.pid


def _entry(task: str) -> dict:
    return reasoning_gym.create_dataset(task, size=1, seed=1)[0]


def _score(task: str, answer: str, entry: dict) -> float:
    return run_in_worker("reasoning_gym_score", task, answer, entry, timeout_s=30, setup="import_reasoning_gym")


def test_worker_starts_with_no_secrets_in_an_empty_folder_under_limits(own_pool):
    pid = _worker_pid()
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item)
    assert set(environ) <= {*WORKER_ENV_KEYS, "PYTHONDONTWRITEBYTECODE"}
    assert not set(SECRETS.values()) & set(environ.values())
    folder = os.readlink(f"/proc/{pid}/cwd")
    assert folder != os.getcwd() and os.listdir(folder) == []
    limits = {line[:26].strip(): line[26:].split() for line in Path(f"/proc/{pid}/limits").read_text().splitlines()}
    assert limits["Max file size"][:2] == ["0", "0"] and limits["Max core file size"][:2] == ["0", "0"]
    assert limits["Max address space"][:2] == [str(MEMORY_LIMIT_BYTES)] * 2
    shutdown_workers()
    assert not os.path.exists(folder)


def test_code_in_the_worker_cannot_read_the_callers_secrets(own_pool):
    entry = _entry("polynomial_multiplication")
    leak = f"({entry['answer']}) if __import__('os').environ.get('SELFOPD_TEST_SECRET') else 0"
    control = f"({entry['answer']}) if __import__('os').environ.get('PATH') else 0"
    assert _score("polynomial_multiplication", control, entry) == 1.0  # the payload does run here
    assert _score("polynomial_multiplication", leak, entry) == 0.0


@pytest.mark.parametrize("payload, event", [
    ("__import__('os').system('touch {marker}')", "os.system"),
    ("__import__('subprocess').run(['touch', '{marker}'])", "subprocess.Popen"),
    ("open('{marker}', 'w').write('x')", "open"),
    ("__import__('pathlib').Path('{marker}').touch()", "os.utime"),
    ("__import__('os').mkdir('{marker}')", "os.mkdir"),
    ("__import__('socket').socket()", "socket.__new__"),
    ("__import__('os').kill(__import__('os').getppid(), 0)", "os.kill"),
])
def test_code_in_the_worker_cannot_write_files_or_start_processes(own_pool, tmp_path, payload, event):
    marker = tmp_path / "written"
    error = _raised(lambda: _score("countdown", payload.format(marker=marker), _entry("countdown")))
    assert not marker.exists()
    assert isinstance(error, WorkerError) and re.search(f"tried '{event}' in worker .*, which was stopped", str(error))
    assert run_in_worker("echo", 1, timeout_s=60) == 1  # a fresh worker took its place


def _raised(call) -> Exception | None:
    """The exception `call()` raised, if any (checked after its side effects are)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _fake_worker(folder: Path, body: str) -> str:
    """An executable that stands in for `python -m selfopd.verifiers.worker` (its arguments ignored)."""
    script = folder / "fake_worker"
    script.write_text(f"#!{sys.executable}\nimport json, os, pickle, struct, sys\n"
                      "def send(payload):\n"
                      "    sys.stdout.buffer.write(struct.pack('>I', len(payload)) + payload)\n"
                      "    sys.stdout.flush()\n" + body)
    script.chmod(0o755)
    return str(script)


def test_a_reply_is_never_unpickled(own_pool, monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    monkeypatch.setattr(timeout.sys, "executable", _fake_worker(tmp_path, (
        "class Evil:\n"
        f"    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
        "send(pickle.dumps(Evil()))\n"
        "sys.stdin.read()\n")))
    error = _raised(lambda: run_in_worker("echo", 1, timeout_s=10))
    assert not marker.exists(), "the reply was unpickled"
    assert isinstance(error, WorkerError) and "sent malformed frame" in str(error)


def test_a_score_out_of_range_is_not_a_reward(own_pool, monkeypatch, tmp_path):
    monkeypatch.setattr(timeout.sys, "executable", _fake_worker(tmp_path, (
        "send(json.dumps({'tuple': ['ready', os.getpid()]}).encode())\n"
        "while True:\n"
        "    length = sys.stdin.buffer.read(4)\n"
        "    task = json.loads(sys.stdin.buffer.read(struct.unpack('>I', length)[0]))['tuple'][0]\n"
        "    send(json.dumps({'tuple': ['ok', None if task == 'import_reasoning_gym' else 7.0]}).encode())\n")))
    result = verify_reasoning_gym("<answer>1</answer>", "chain_sum", _entry("chain_sum"))
    assert result.unchecked and result.reward == 0.0 and not result.correct
