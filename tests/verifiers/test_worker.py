"""The verifier worker runs with the least it needs, and the parent trusts none of its replies.

The payloads here are sent to the worker's scorer task directly, past the answer grammars, as
code would run if a grammar ever had a hole: what can that code still do? The worker runs in
its sandbox (the default mode); `test_isolation.py` runs hostile programs in that same profile
without the worker's audit hook.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import reasoning_gym

import selfopd.verifiers.isolation as isolation
import selfopd.verifiers.timeout as timeout
from selfopd.verifiers import CheckTimeout, WorkerError, run_in_worker, shutdown_workers, verify_reasoning_gym
from selfopd.verifiers.timeout import ISOLATION_ENV, WORKER_ENV_KEYS, WORKER_LIMITS
from selfopd.verifiers.worker import MEMORY_LIMIT_BYTES

SECRETS = {"HF_TOKEN": "hf_secret", "WANDB_API_KEY": "wandb-secret", "OPENAI_API_KEY": "sk-secret",
           "SELFOPD_TEST_SECRET": "s3cret"}


@pytest.fixture
def own_pool(monkeypatch):
    """Workers of this test's own, started under its environment (the default isolation), stopped after it."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    monkeypatch.setattr(timeout, "_pool", None)
    yield
    shutdown_workers()
    timeout.set_isolation(None)


needs_sandbox = pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                   reason=f"no sandbox here: {isolation.unavailable_reason()}")


def _worker_pid() -> int:
    run_in_worker("echo", None, timeout_s=60)
    return timeout._get_pool().idle[-1].proc.pid


def _entry(task: str) -> dict:
    return reasoning_gym.create_dataset(task, size=1, seed=1)[0]


def _score(task: str, answer: str, entry: dict) -> float:
    return run_in_worker("reasoning_gym_score", task, answer, entry, timeout_s=30, setup="import_reasoning_gym")


def test_a_limits_mode_worker_starts_with_no_secrets_in_an_empty_folder_under_limits(own_pool):
    timeout.set_isolation("limits")
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


def _host_processes(pid_namespace: str) -> dict[int, str]:
    """Host pid -> /proc status of every process in the pid namespace `pid_namespace`."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "pid") == pid_namespace:
                found[int(entry.name)] = (entry / "status").read_text()
        except OSError:
            continue
    return found


def _field(status: str, name: str) -> list[str]:
    """The values on the `name:` line of a /proc status text."""
    return next(line.split()[1:] for line in status.splitlines() if line.startswith(f"{name}:"))


@needs_sandbox
def test_the_worker_runs_in_its_sandbox(own_pool):
    facts = run_in_worker("facts", timeout_s=60)
    own = {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in facts["namespaces"]}
    kinds = ["pid", "net", "ipc", "uts", "mnt"] + (["user"] if os.geteuid() != 0 else [])
    assert all(facts["namespaces"][kind] != own[kind] for kind in kinds), facts["namespaces"]
    assert facts["interfaces"] == ["lo"] and facts["uid"] != 0 and facts["gid"] != 0
    assert facts["cwd"] == isolation.SCRATCH and facts["cwd_entries"] == []
    assert facts["environ"]["HOME"] == isolation.SCRATCH
    assert set(facts["environ"]) <= {*WORKER_ENV_KEYS, "PYTHONDONTWRITEBYTECODE", "MPLCONFIGDIR", "TMPDIR", "PWD",
                                     "LC_CTYPE"}
    assert not set(SECRETS.values()) & set(facts["environ"].values())
    # /home and /tmp exist inside only as the way to a bound folder (a checkout under /tmp or a home)
    bound = {Path(destination).parts[1] for _, destination in isolation._binds(
        [*isolation.python_paths(), *timeout._package_paths()])}
    assert not ({"home", "tmp"} & set(facts["root_entries"])) - bound, (facts["root_entries"], bound)
    assert facts["limits"]["RLIMIT_NPROC"] == [WORKER_LIMITS.processes] * 2
    assert facts["limits"]["RLIMIT_AS"] == [MEMORY_LIMIT_BYTES] * 2 == [WORKER_LIMITS.memory_bytes] * 2
    assert facts["limits"]["RLIMIT_FSIZE"] == [0, 0] and facts["limits"]["RLIMIT_CORE"] == [0, 0]
    # Seen from the host: the worker process holds no secret and is not root there either.
    processes = _host_processes(facts["namespaces"]["pid"])
    worker = next(pid for pid, status in processes.items() if _field(status, "NSpid")[-1] == str(facts["pid"]))
    assert not any(value.encode() in Path(f"/proc/{worker}/environ").read_bytes() for value in SECRETS.values())
    host_uid = int(_field(processes[worker], "Uid")[0])
    assert host_uid != 0 and (os.geteuid() == 0 or host_uid == os.geteuid())
    folder = timeout._get_pool().idle[-1].folder
    shutdown_workers()
    assert not os.path.exists(folder)


@needs_sandbox
def test_a_killed_worker_leaves_nothing_of_its_sandbox_running(own_pool):
    namespace = run_in_worker("facts", timeout_s=60)["namespaces"]["pid"]
    assert _host_processes(namespace)
    with pytest.raises(CheckTimeout):
        run_in_worker("sleep", 60, timeout_s=0.5)
    deadline = time.monotonic() + 3  # well before the worker's own backstop alarm (6 s) would end it
    while _host_processes(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _host_processes(namespace)


def test_the_isolation_mode_is_chosen_by_environment_or_call(own_pool, monkeypatch):
    host_net = os.readlink("/proc/self/ns/net")
    monkeypatch.setenv(ISOLATION_ENV, "limits")
    assert run_in_worker("facts", timeout_s=60)["namespaces"]["net"] == host_net
    shutdown_workers()
    monkeypatch.setenv(ISOLATION_ENV, "sandbx")
    with pytest.raises(ValueError, match=f"^{ISOLATION_ENV}='sandbx' is not one of sandbox, limits$"):
        run_in_worker("echo", 1, timeout_s=60)
    timeout.set_isolation("limits")  # a call wins over the environment
    assert run_in_worker("echo", 2, timeout_s=60) == 2
    with pytest.raises(ValueError, match="must be one of"):
        timeout.set_isolation("none")


def test_without_bubblewrap_the_worker_says_why_and_what_to_do(own_pool, monkeypatch, tmp_path):
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    isolation.unavailable_reason.cache_clear()
    try:
        with pytest.raises(WorkerError) as raised:
            run_in_worker("echo", 1, timeout_s=60)
        message = str(raised.value)
        assert "\n" not in message and "bwrap (bubblewrap) is not installed" in message
        assert "apt install bubblewrap" in message and f"{ISOLATION_ENV}=limits" in message
        assert timeout._get_pool().count == 0  # nothing started, nothing held
        timeout.set_isolation("limits")
        assert run_in_worker("echo", 3, timeout_s=60) == 3  # the weaker mode, chosen explicitly
    finally:
        monkeypatch.setenv("PATH", path)  # before the probe is tried again (the fixture's own patches stay)
        isolation.unavailable_reason.cache_clear()


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
    timeout.set_isolation("limits")  # the stand-in runs where the parent starts it, as our worker does
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
    timeout.set_isolation("limits")
    monkeypatch.setattr(timeout.sys, "executable", _fake_worker(tmp_path, (
        "send(json.dumps({'tuple': ['ready', os.getpid()]}).encode())\n"
        "while True:\n"
        "    length = sys.stdin.buffer.read(4)\n"
        "    task = json.loads(sys.stdin.buffer.read(struct.unpack('>I', length)[0]))['tuple'][0]\n"
        "    send(json.dumps({'tuple': ['ok', None if task == 'import_reasoning_gym' else 7.0]}).encode())\n")))
    result = verify_reasoning_gym("<answer>1</answer>", "chain_sum", _entry("chain_sum"))
    assert result.unchecked and result.reward == 0.0 and not result.correct


def test_a_worker_writing_endless_lines_to_stderr_is_read_in_bounded_pieces(own_pool, monkeypatch, tmp_path):
    timeout.set_isolation("limits")
    monkeypatch.setattr(timeout.sys, "executable", _fake_worker(tmp_path, (
        "sys.stderr.buffer.write(b'x' * 1_000_000 + b'\\nlast words\\n')\n"
        "sys.stderr.flush()\n")))
    worker = timeout._Worker()
    try:
        error = _raised(worker.wait_ready)
        worker.drain.join(timeout=10)
        assert isinstance(error, WorkerError) and str(error).endswith("exited (code 0): last words")
        assert max(map(len, worker.stderr_tail)) == timeout._STDERR_LINE_BYTES
    finally:
        worker.kill()
