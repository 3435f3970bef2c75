"""The sandbox holds: hostile programs run inside the verifier worker's own profile
(`timeout.worker_sandbox_command`: its limits, package and Python) and fail to reach the network,
write outside their scratch folder, read the caller's environment or home, or fork without end.

Each hostile program also runs once as a plain child process (what the "limits" mode starts,
without the worker's audit hook), where it succeeds: the check can fail.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import selfopd.verifiers.isolation as isolation
import selfopd.verifiers.timeout as timeout

ROOT = Path(__file__).resolve().parents[2]
NEEDS_SANDBOX = pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                   reason=f"no sandbox here: {isolation.unavailable_reason()}")


def _sandboxed(code: str, scratch: Path, *args: str) -> list[str]:
    scratch.mkdir(exist_ok=True)
    return timeout.worker_sandbox_command([sys.executable, "-c", code, *args], scratch)


def _run(command: list[str], cwd: Path | None = None) -> dict:
    """The JSON the program printed last (the worker's environment, as a worker starts)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd, env=timeout.worker_environment())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


NETWORK = """
import json, socket, sys
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as e:
        return type(e).__name__
out = {"host": attempt(lambda: socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()),
       "dns": attempt(lambda: socket.getaddrinfo("pypi.org", 443)),
       "external": attempt(lambda: socket.create_connection(("1.1.1.1", 53), timeout=3).close()),
       "interfaces": sorted(name for _, name in socket.if_nameindex())}
print(json.dumps(out))
"""


@NEEDS_SANDBOX
def test_no_network_not_even_the_hosts_loopback(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        inside = _run(_sandboxed(NETWORK, tmp_path / "scratch", port))
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing from the sandbox reached it
        outside = _run([sys.executable, "-c", NETWORK, port])
    assert outside["host"] == "ok"  # the program does connect where it may
    assert inside["host"] != "ok" and inside["dns"] != "ok" and inside["external"] != "ok"
    assert inside["interfaces"] == ["lo"]


WRITE = """
import json, sys
out = {}
for path in sys.argv[1:]:
    try:
        open(path, "x").close()
        out[path] = "written"
    except OSError as e:
        out[path] = type(e).__name__
print(json.dumps(out))
"""


@NEEDS_SANDBOX
def test_writes_land_in_the_scratch_folder_only(tmp_path):
    name = f"selfopd-sandbox-{uuid.uuid4().hex}"
    outside = [tmp_path / name, ROOT / name, ROOT / "verifiers" / name, Path("/tmp") / name,
               Path(sys.prefix) / name, Path(sys.executable).parent / name]
    scratch = tmp_path / "scratch"
    try:
        inside = _run(_sandboxed(WRITE, scratch, *map(str, outside), f"{isolation.SCRATCH}/{name}"))
        assert [p for p in outside if p.exists()] == []
        assert {inside[str(p)] for p in outside} <= {"OSError", "FileNotFoundError", "PermissionError"}, inside
        assert inside[f"{isolation.SCRATCH}/{name}"] == "written"
        assert (scratch / name).exists()  # the scratch folder is the host folder we gave
        control = _run([sys.executable, "-c", WRITE, str(tmp_path / name)])
        assert control == {str(tmp_path / name): "written"}
    finally:
        for path in outside:
            if path.is_file():
                path.unlink()


SECRETS = """
import glob, json, os, sys
secret = sys.argv[1]
found = [k for k, v in os.environ.items() if secret in v]
for path in [f"/proc/{sys.argv[2]}/environ", *glob.glob("/proc/[0-9]*/environ")]:
    try:
        with open(path, "rb") as f:
            if secret.encode() in f.read():
                found.append(path)
    except OSError:
        pass
print(json.dumps({"found": found}))
"""


@NEEDS_SANDBOX
def test_the_callers_environment_is_out_of_sight(tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SELFOPD_TEST_SECRET", secret)
    # /proc/<pid>/environ shows the environment a process started with: a caller started with the secret.
    caller = subprocess.Popen(["sleep", "60"], env={**os.environ})
    try:
        inside = _run(_sandboxed(SECRETS, tmp_path / "scratch", secret, str(caller.pid)))
        outside = _run([sys.executable, "-c", SECRETS, secret, str(caller.pid)])
    finally:
        caller.kill()
        caller.wait()
    assert inside == {"found": []}
    assert f"/proc/{caller.pid}/environ" in outside["found"]  # a plain child can read it


HOME = """
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            out[path] = f.read()
    except OSError as e:
        out[path] = type(e).__name__
out["listing"] = sorted(os.listdir(os.path.dirname(sys.argv[1]))) if os.path.isdir(os.path.dirname(sys.argv[1])) else None
print(json.dumps(out))
"""


@NEEDS_SANDBOX
def test_a_file_in_the_users_home_is_out_of_sight(tmp_path):
    home = Path(os.path.expanduser("~"))
    planted = home / f".selfopd-sandbox-test-{uuid.uuid4().hex}"
    try:
        planted.write_text("token")
    except OSError:
        pytest.skip(f"cannot plant a file in {home}")
    try:
        inside = _run(_sandboxed(HOME, tmp_path / "scratch", str(planted)))
        outside = _run([sys.executable, "-c", HOME, str(planted)])
    finally:
        planted.unlink()
    assert outside[str(planted)] == "token"
    assert inside[str(planted)] == "FileNotFoundError"
    assert inside["listing"] is None or planted.name not in inside["listing"]


BOMB = """
import os, sys, time
made, error = 0, 0
try:
    while made < int(sys.argv[1]):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
except OSError as e:
    error = e.errno
print(made, error, flush=True)
time.sleep(60)
"""


def _bomb(command: list[str]) -> tuple[int, int]:
    """(processes made, errno that stopped it) from a fork bomb, then the sandbox killed as a caller
    kills one (SIGKILL to bwrap's session); nothing of it may be left running."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the bomb did not report within 30 s"
        made, error = map(int, proc.stdout.readline().split())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    marker = command[-1]
    deadline = time.monotonic() + 10
    while (left := _running_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"{len(left)} processes of the bomb outlived its sandbox"
    return made, error


def _running_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker` (zombies of the bomb count as gone)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@NEEDS_SANDBOX
def test_a_fork_bomb_stops_at_the_process_limit_and_dies_with_its_sandbox(tmp_path):
    limit = timeout.WORKER_LIMITS.processes
    made, error = _bomb(_sandboxed(BOMB, tmp_path / "scratch", "1000", f"bomb-{uuid.uuid4().hex}"))
    assert error == errno.EAGAIN and 0 < made < limit
    # The limit is what stopped it: with room for more, the same bomb makes all it asks for.
    roomy = isolation.sandbox_command([sys.executable, "-c", BOMB, "40", f"bomb-{uuid.uuid4().hex}"], tmp_path / "scratch",
                                      limits=isolation.Limits(processes=64))
    assert _bomb(roomy) == (40, 0)


NON_ROOT = """
import importlib.util, json, subprocess, sys, tempfile
from pathlib import Path
spec = importlib.util.spec_from_file_location("isolation", sys.argv[1])
isolation = importlib.util.module_from_spec(spec)
sys.modules["isolation"] = isolation
spec.loader.exec_module(isolation)
reason = isolation.unavailable_reason()
if reason:
    print(json.dumps({"reason": reason}))
    raise SystemExit
bomb = "import os\\nmade = 0\\ntry:\\n    while made < 1000:\\n        if os.fork() == 0:\\n            import time; time.sleep(5); os._exit(0)\\n        made += 1\\nexcept OSError:\\n    pass\\nprint(made)"
facts = "import json, os; print(json.dumps([os.getuid(), os.readlink('/proc/self/ns/user'), sorted(os.listdir('/'))]))"
scratch = Path(tempfile.mkdtemp())
run = lambda code: subprocess.run(isolation.sandbox_command([sys.executable, "-c", code], scratch,
                                  limits=isolation.Limits(processes=16)), capture_output=True, text=True, timeout=60)
print(json.dumps({"made": int(run(bomb).stdout), "facts": json.loads(run(facts).stdout)}))
"""


def _python_for_nobody() -> str | None:
    """An interpreter uid 65534 may run, with setpriv to become it (root only), or None."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    for python in (sys.executable, "/usr/bin/python3"):
        sees_itself = ("import os, sys; sys.exit(not (os.path.exists(os.path.realpath(sys.executable)) and "
                       f"os.path.isdir(sys.base_prefix) and os.access({isolation.__file__!r}, os.R_OK)))")
        if os.path.exists(python) and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                                      python, "-c", sees_itself], capture_output=True).returncode == 0:
            return python
    return None


@NEEDS_SANDBOX
def test_as_a_non_root_user_the_process_limit_counts_this_sandbox_only(tmp_path):
    """CI runs as root, users mostly not: the user-namespace profile, run by uid 65534. Its limit
    is set inside the new user namespace, so it counts the sandbox's processes, not the user's."""
    python = _python_for_nobody()
    if python is None:
        pytest.skip("needs root, setpriv and a Python that uid 65534 can run")
    holders = [subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "30"])
               for _ in range(20)]  # the user's other processes: more than the sandbox's limit
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", NON_ROOT,
                               str(Path(isolation.__file__))], capture_output=True, text=True, timeout=120,
                              cwd="/", env={"PATH": os.environ.get("PATH", os.defpath)})
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    if "reason" in out:
        pytest.skip(f"no unprivileged sandbox here: {out['reason']}")
    uid, user_namespace, root_entries = out["facts"]
    assert uid == isolation.SANDBOX_UID and user_namespace != os.readlink("/proc/self/ns/user")
    assert 0 < out["made"] < 16 and "home" not in root_entries and "root" not in root_entries


@NEEDS_SANDBOX
@pytest.mark.parametrize("start, survives", [(isolation.popen, True), (subprocess.Popen, False)])
def test_a_sandbox_outlives_the_thread_that_started_it(tmp_path, start, survives):
    """bwrap's --die-with-parent is the starting *thread's* death (PR_SET_PDEATHSIG): a worker started from a
    thread pool's thread would die with it. `isolation.popen` starts it from a thread as long-lived as we are."""
    command = isolation.sandbox_command([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(30)"],
                                        tmp_path)
    started: list[subprocess.Popen] = []

    def in_a_thread() -> None:  # waits until bwrap is set up (it arms the signal then), then ends
        started.append(start(command, stdout=subprocess.PIPE, start_new_session=True))
        started[0].stdout.readline()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(timeout=30)
    try:
        deadline = time.monotonic() + 2
        while started[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (started[0].poll() is None) == survives
    finally:
        if started[0].poll() is None:
            os.killpg(started[0].pid, signal.SIGKILL)
        started[0].wait()
        started[0].stdout.close()


def test_the_reason_a_sandbox_cannot_start_is_one_line(tmp_path, monkeypatch):
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))
    isolation.unavailable_reason.cache_clear()
    try:
        assert isolation.unavailable_reason() == "bwrap (bubblewrap) is not installed"
        fake = tmp_path / "bwrap"  # what bwrap says where user namespaces are refused
        fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
        fake.chmod(0o755)
        isolation.unavailable_reason.cache_clear()
        reason = isolation.unavailable_reason()
        assert reason == "bwrap could not start a sandbox (exit 1): bwrap: setting up uid map: Permission denied"
    finally:
        monkeypatch.setenv("PATH", path)  # before the probe is tried again
        isolation.unavailable_reason.cache_clear()


def test_binds_cover_each_path_once_and_links_at_both_ends(tmp_path):
    real = tmp_path / "real"
    (real / "lib").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    binds = isolation._binds([tmp_path / "link", real / "lib", Path("/usr/lib"), tmp_path / "missing"])
    assert binds == [(str(real), str(tmp_path / "link")), (str(real), str(real))]
