"""Run a program behind an OS boundary: a bubblewrap (`bwrap`) sandbox with resource limits.

Model-written text reaches code in the verifier worker (scorers, sympy) and, later, model-written
programs run against tests. An audit hook or an answer grammar is only as good as its last
hole; this is the wall behind them. `sandbox_command` builds the argv that runs a program:

  - in new pid, net, ipc, uts and cgroup namespaces, and a new user namespace where it runs as
    uid/gid 65534 (no network but a private loopback; it sees only its own processes),
  - with a fresh root holding, read-only, the system libraries (/usr), the running Python
    (installation, venv, site-packages) and the paths the caller names; no home, no /root, no
    /etc but the loader cache and local time; /proc, a minimal /dev and one writable scratch folder
    (`SCRATCH` inside: the working directory, HOME and TMPDIR),
  - with only the environment it is given (--clearenv), in its own session (--new-session: no
    TIOCSTI into our terminal), and killed when bwrap is (--die-with-parent),
  - under rlimits set by a small launcher inside (`_LAUNCHER`, run by our interpreter) just
    before it execs the program: address space, CPU seconds, file size, open files, no core
    dumps, and a process count (threads included) that stops a fork bomb.

The process count is RLIMIT_NPROC, which the kernel counts per (user namespace, uid) and never
enforces for uid 0 of the host. Non-root callers: the launcher sets it inside the new user
namespace, so it counts this sandbox's processes only, not the caller's others. Root callers:
a user namespace would map the program to host uid 0 (exempt from the limit, and the owner of
every root file it can see), so bwrap sets up the same namespaces without one (root may) and
the launcher drops to a random unprivileged uid of its own (and no capabilities) before it
execs; the count is that uid's processes, that is this sandbox's. The scratch folder is given
to that uid. bwrap sets no_new_privs in both cases.

Output size is the caller's to bound (it reads the pipes). `unavailable_reason` says, once per
process, why no sandbox can start here (bwrap missing, user namespaces refused). Start sandboxes
with `popen`: --die-with-parent kills bwrap when the *thread* that started it ends (Linux's
PR_SET_PDEATHSIG), so they are started from one long-lived thread of this process.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import random
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRATCH = "/scratch"  # where the writable scratch folder appears inside the sandbox
SANDBOX_UID = 65534  # the uid (and gid) a program has inside a user namespace: nobody
# Root callers: a random uid per sandbox from a range no distribution or container tool hands
# out (below systemd's 0x7FFE0000 and 2^31), so its process count is this sandbox's alone.
_ROOT_UID_RANGE = (0x70000000, 0x7FFE0000)
# System folders: bound read-only where they are folders, recreated where they are links (/lib
# -> usr/lib on merged-/usr systems).
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's cache; local time for `time`
_PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Limits:
    """What one sandboxed program may use; None leaves that limit as the caller has it.

    cpu_seconds suits one-shot programs (SIGXCPU at it, which ends a Python program, and SIGKILL
    a second later); a long-lived worker that runs many checks is bounded by its caller's per-check
    deadline instead. processes counts threads too.
    """

    memory_bytes: int | None = 4 << 30
    cpu_seconds: int | None = None
    file_bytes: int | None = 0
    processes: int = 32
    open_files: int | None = 256

    def rlimits(self) -> dict[str, int]:
        """The launcher's rlimits by name (soft = hard)."""
        named = {"RLIMIT_AS": self.memory_bytes, "RLIMIT_CPU": self.cpu_seconds, "RLIMIT_FSIZE": self.file_bytes,
                 "RLIMIT_NPROC": self.processes, "RLIMIT_NOFILE": self.open_files, "RLIMIT_CORE": 0}
        return {name: value for name, value in named.items() if value is not None}


# Runs inside, as the sandbox's first program: limits, (root callers) a drop to an unprivileged
# uid, then exec. Each limit is capped at the hard limit we were given (lowering needs no right).
_LAUNCHER = """\
import json, os, resource, sys
spec = json.loads(sys.argv[1])
for name, value in spec["limits"].items():
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    top = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL at the hard
    top = top if hard == resource.RLIM_INFINITY else min(top, hard)
    resource.setrlimit(kind, (value, top))
if spec.get("ready_fd") is not None:  # the caller's clock starts now: the sandbox is up
    os.write(spec["ready_fd"], b"1")
    os.close(spec["ready_fd"])
uid = spec["uid"]
if uid is not None:
    if spec["scratch"] is not None:
        os.chown(spec["scratch"], uid, uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        sys.exit("isolation launcher: could not drop to uid %d" % uid)
os.execv(sys.argv[2], sys.argv[2:])
"""


# A seccomp filter (classic BPF, loaded by bwrap with --seccomp FD) for programs that need no system
# administration at all: model-written code. Denied with EPERM: new namespaces (unshare, setns, and
# clone with a CLONE_NEW* flag: a root caller's sandbox has no user namespace of its own that could
# forbid them), mounts, ptrace and process_vm_*, bpf, keyrings, userfaultfd, io_uring, perf events,
# kernel modules and kexec, chroot, swap, reboot, syslog, quotas, x86 port I/O; clone3 answers ENOSYS
# (its flags sit in memory a filter cannot read; the C library falls back to clone). Another
# architecture's calling convention (32-bit calls from a 64-bit process, x32) is refused whole.
_SECCOMP_DENIED = ("unshare setns mount umount2 pivot_root ptrace process_vm_readv process_vm_writev bpf keyctl "
                   "add_key request_key userfaultfd io_uring_setup io_uring_enter io_uring_register perf_event_open "
                   "kexec_load kexec_file_load init_module finit_module delete_module open_by_handle_at open_tree "
                   "move_mount fsopen fsconfig fsmount fspick mount_setattr chroot acct swapon swapoff reboot syslog "
                   "quotactl iopl ioperm").split()
_SYSCALLS = {  # (audit arch, {name: number}), from the kernel's tables (x86_64: unistd_64.h; arm64: asm-generic)
    "x86_64": (0xC000003E, dict(zip(
        ["clone", "clone3", *_SECCOMP_DENIED],
        [56, 435, 272, 308, 165, 166, 155, 101, 310, 311, 321, 250, 248, 249, 323, 425, 426, 427, 298, 246, 320, 175,
         313, 176, 304, 428, 429, 430, 431, 432, 433, 442, 161, 163, 167, 168, 169, 103, 179, 172, 173]))),
    "aarch64": (0xC00000B7, dict(zip(
        ["clone", "clone3", *_SECCOMP_DENIED[:-2]],
        [220, 435, 97, 268, 40, 39, 41, 117, 270, 271, 280, 219, 217, 218, 282, 425, 426, 427, 241, 104, 294, 105,
         273, 106, 265, 428, 429, 430, 431, 432, 433, 442, 51, 89, 224, 225, 142, 116, 60]))),
}
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000  # NS..NET


def seccomp_filter() -> bytes | None:
    """The filter above as bwrap reads it (struct sock_filter[]), or None on an architecture it has no
    table for (the sandbox then runs without it)."""
    import errno
    import platform
    import struct

    machine = platform.machine()
    table = _SYSCALLS.get({"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine))
    if table is None:
        return None
    arch, numbers = table
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (load, 0, 0, 0)]  # arch, then the call's number
    if machine in ("x86_64", "amd64"):
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 ABI
    program += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, enosys)]
    program += [(jeq, 0, 4, numbers["clone"]), (load, 0, 0, 16), (jset, 0, 1, _CLONE_NEW), (ret, 0, 0, eperm),
                (ret, 0, 0, allow)]  # clone: its flags (first argument, low word) hold no CLONE_NEW*
    for name in _SECCOMP_DENIED:
        if name in numbers:
            program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, eperm)]
    program += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def seccomp_fd() -> int | None:
    """A pipe's read end holding `seccomp_filter()` for sandbox_command's seccomp_fd (pass it to Popen's
    pass_fds, close it after), or None where there is no filter for this architecture."""
    data = seccomp_filter()
    if data is None:
        return None
    read, write = os.pipe()
    try:
        os.write(write, data)  # a few hundred bytes: within a pipe's buffer
    finally:
        os.close(write)
    return read


def bwrap_path() -> str | None:
    """bubblewrap's executable, or None when it is not installed (Debian: apt install bubblewrap)."""
    return shutil.which("bwrap")


def python_paths() -> list[Path]:
    """The folders the running interpreter needs to start and import its packages: its
    installation, its venv and site-packages (the user's site only when this process uses it)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *sysconfig.get_paths().values(),
             *site.getsitepackages()]
    user_site = site.getusersitepackages()
    if user_site in sys.path:
        paths.append(user_site)
    return [Path(p) for p in paths if p]


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _binds(paths: Iterable[Path]) -> list[tuple[str, str]]:
    """(source, destination) pairs for `paths`: each at its real location and, when it is reached
    through a link (/home -> /gpfs/home), at its own path too; none under a system folder or
    inside another (it comes with that one)."""
    system = [p for p in _SYSTEM if os.path.isdir(p) or os.path.islink(p)]
    sources: dict[str, str] = {}
    for path in paths:
        if os.path.exists(path):
            real = os.path.realpath(path)
            for destination in (real, os.path.abspath(path)):
                sources.setdefault(destination, real)
    kept: list[tuple[str, str]] = []
    for destination in sorted(sources):
        if not any(_inside(destination, other) for other in [*system, *(d for _, d in kept)]):
            kept.append((sources[destination], destination))
    return kept


def _parents(destinations: Iterable[str]) -> list[str]:
    """Every folder above the bound paths, made explicitly so that it is 0755 (bwrap makes the
    ones it adds on its own 0700 when root runs it: /root/... would be closed to the program)."""
    above = {str(parent) for path in destinations for parent in Path(path).parents if str(parent) != "/"}
    return sorted(above, key=lambda p: (p.count("/"), p))


def sandbox_command(argv: Sequence[str], scratch: Path, *, limits: Limits = Limits(),
                    read_only: Iterable[Path] = (), env: Mapping[str, str] | None = None,
                    scratch_read_only: bool = False, tmp_bytes: int | None = None,
                    ready_fd: int | None = None, seccomp_fd: int | None = None) -> list[str]:
    """The argv that runs `argv` in the sandbox described above, `scratch` (a host folder) as its
    writable SCRATCH, `read_only` and the running Python bound read-only at their own paths, and
    `env` (plus HOME and TMPDIR = SCRATCH) as its whole environment. argv[0] must be an absolute
    path that is inside a bound folder (the launcher execs it without a PATH search).
    Root callers: the scratch folder is chowned to the program's uid when it starts.
    scratch_read_only: SCRATCH is bound read-only (a program's files, which it may not change).
    tmp_bytes: a private tmpfs of at most that many bytes at /tmp (in memory, gone with the
    sandbox, TMPDIR): room to write that cannot fill the host's disk.
    ready_fd: a descriptor of ours (pass it to Popen's pass_fds) that the launcher writes one byte to
    and closes when the sandbox is set up, just before its limits and the program: a caller's time
    limit can start there rather than count bwrap's set-up on a busy machine.
    seccomp_fd: a descriptor to read a seccomp filter from (`seccomp_fd()`; pass_fds too), applied to
    the launcher and the program."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise FileNotFoundError("bwrap (bubblewrap) is not installed")
    binds = _binds([*python_paths(), *map(Path, read_only)])
    as_root = os.geteuid() == 0
    if as_root:  # the same namespaces minus the user one; the launcher drops to its own uid
        command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                   "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                   "--cap-add", "CAP_CHOWN"]
    else:
        command = [bwrap, "--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if _bwrap_can_disable_userns(bwrap):  # no user namespace of its own inside ours (bwrap >= 0.8)
            command += ["--unshare-user", "--disable-userns"]  # --unshare-all's user namespace is only a "try"
    command += ["--die-with-parent", "--new-session", "--clearenv"]
    tmpdir = "/tmp" if tmp_bytes is not None else SCRATCH
    for name, value in {**(env or {}), "HOME": SCRATCH, "TMPDIR": tmpdir}.items():
        command += ["--setenv", name, value]
    for path in _SYSTEM:
        if os.path.islink(path):
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    for path in _ETC:
        command += ["--ro-bind-try", path, path]
    for folder in _parents(destination for _, destination in binds):
        command += ["--dir", folder]
    for source, destination in binds:
        command += ["--ro-bind", source, destination]
    command += ["--proc", "/proc", "--dev", "/dev", "--ro-bind" if scratch_read_only else "--bind", str(scratch),
                SCRATCH, "--chdir", SCRATCH]
    if tmp_bytes is not None:
        command += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    command += ["--remount-ro", "/"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    uid = random.SystemRandom().randrange(*_ROOT_UID_RANGE) if as_root else None
    spec = {"limits": limits.rlimits(), "uid": uid, "scratch": None if scratch_read_only else SCRATCH,
            "ready_fd": ready_fd}
    launcher = os.path.realpath(sys.executable)
    return [*command, "--", launcher, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec), *argv]


@functools.lru_cache(maxsize=4)
def _bwrap_can_disable_userns(bwrap: str) -> bool:
    """Whether this bwrap has --disable-userns (0.8.0 on): read from its --help once."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, env={})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in done.stdout + done.stderr


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why no sandbox can start in this process, in one line, or None when one can. Tried once
    (a few tens of milliseconds): bwrap missing, or its own error (user namespaces refused...)."""
    if bwrap_path() is None:
        return "bwrap (bubblewrap) is not installed"
    scratch = tempfile.mkdtemp(prefix="selfopd-sandbox-probe-")
    try:
        command = sandbox_command([os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"], Path(scratch))
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S,
                              env={})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not be run: {e}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
        return f"bwrap could not start a sandbox (exit {done.returncode}): " + (lines[-1][:300] if lines else "no message")
    return None


_Request = tuple[list[str], dict[str, Any], "Future[subprocess.Popen[bytes]]"]
_spawner: tuple[int, queue.SimpleQueue[_Request]] | None = None
_spawner_lock = threading.Lock()


def popen(command: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen(command, **kwargs), started from this process's spawner thread, which lives
    as long as the process: a sandbox dies with its caller's process, not with the caller's thread."""
    future: Future[subprocess.Popen[bytes]] = Future()
    _requests().put((list(command), kwargs, future))
    return future.result()


def _requests() -> queue.SimpleQueue[_Request]:
    """This process's spawner queue (a forked child starts its own thread: the parent's is not in it)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
            threading.Thread(target=_spawn, args=(requests,), name="sandbox-spawner", daemon=True).start()
            _spawner = (os.getpid(), requests)
        return _spawner[1]


def _spawn(requests: queue.SimpleQueue[_Request]) -> None:
    while True:
        command, kwargs, future = requests.get()
        try:
            future.set_result(subprocess.Popen(command, **kwargs))
        except BaseException as e:  # noqa: BLE001  # the caller's to handle, in its own thread
            future.set_exception(e)
