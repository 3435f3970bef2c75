"""Run a model-written Python program against tests, one sandbox per test.

Each test gets its own bubblewrap sandbox (`isolation.sandbox_command`): a fresh scratch folder
holding the program (and, for call and check tests, a fixed harness and the call or check code),
read-only; a small private tmpfs at /tmp to write in (nothing reaches the host's disk); a seccomp
filter (`isolation.seccomp_filter`: no namespaces, mounts, ptrace, bpf, io_uring...); no network but
its own empty loopback; none of our environment, files or processes; rlimits on CPU seconds, address
space, processes (threads count) and file size. Around it, here:

  - a wall-clock deadline (`CodeLimits.time_s + kill_after_s`, from when the sandbox is set up and
    its launcher sets the limits: bwrap's set-up on a busy machine is not the program's): the whole
    sandbox (bwrap's session, its pid namespace with it) is killed with SIGKILL; RLIMIT_CPU alone
    misses a program that sleeps or blocks,
  - a byte budget on stdout and stderr (RLIMIT_FSIZE does not apply to pipes): bytes past it are
    read, counted and discarded; stdout past its budget also ends the run (status "limit"),
  - the comparison: a stdin test's output and a call test's value are compared here, so expected
    values never enter the sandbox.

Statuses: passed | wrong | error (exception, non-zero exit, a signal) | timeout (the wall-clock
kill or SIGXCPU) | limit (memory, output or file size) | sandbox_unavailable (no sandbox can start
here: nothing runs; a program is never run without one).

    results = run_tests(program, parse_tests(rows), CodeLimits(time_s=1.0), workers=2)
"""

from __future__ import annotations

import ast
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import isolation
from .code_tests import (PROGRAM, CallTest, CheckTest, CodeTest, StdinTest, error_tail, parse_test, same_output,
                         same_value)

STATUSES = ("passed", "wrong", "error", "timeout", "limit", "sandbox_unavailable")
STARTUP_S = 30.0  # how long a sandbox may take to set up (a busy machine) before the time limit starts
_HARNESS = "selfopd_harness.py"
_PAYLOAD = "selfopd_test.py"  # the call expression or the check code, read by the harness
# The environment a program starts with, and nothing else: one thread per numeric library (threads
# count as processes), no bytecode files, UTF-8 text.
PROGRAM_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}

# Runs inside: the program imported as module `solution` (its prints go to stderr: stdout carries only
# this harness's result, on a copy of the original stdout), then the call (a task's expression, in the
# program's namespace) or check(entry_point). One JSON line: {"repr": ...} | {"passed": true} |
# {"assertion": ...}. An exception propagates (a traceback on stderr, exit 1).
_HARNESS_CODE = f"""\
import importlib.util, json, os, sys
result = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
kind = sys.argv[1]
payload = open({_PAYLOAD!r}).read()
spec = importlib.util.spec_from_file_location("solution", {PROGRAM!r})
module = importlib.util.module_from_spec(spec)
sys.modules["solution"] = module
spec.loader.exec_module(module)
if kind == "call":
    value = eval(compile(payload, "<test>", "eval"), vars(module))
    line = json.dumps({{"repr": repr(value)}})
else:
    namespace = {{"__name__": "selfopd_check"}}
    exec(compile(payload, "<check>", "exec"), namespace)
    try:
        namespace["check"](getattr(module, sys.argv[2]))
        line = json.dumps({{"passed": True}})
    except AssertionError as e:
        line = json.dumps({{"assertion": str(e)}})
sys.stderr.flush()
result.write(line + "\\n")
result.flush()
"""
@dataclass(frozen=True)
class CodeLimits:
    """What one test run may use. time_s is the CPU limit (whole seconds, rounded up, for RLIMIT_CPU)
    and, plus kill_after_s, the wall-clock limit, which catches a program that sleeps or blocks (SDPO's
    1 s + 1 s); on an oversubscribed machine a program's own start-up can use much of it: raise
    kill_after_s there. memory is address space (RLIMIT_AS)."""

    time_s: float = 1.0
    kill_after_s: float = 1.0
    memory_bytes: int = 1 << 30
    processes: int = 16
    tmp_bytes: int = 16 << 20  # a private in-memory /tmp of this size (0: none); it caps every file written
    open_files: int = 64
    stdout_bytes: int = 1 << 20  # past this the run stops: status "limit"
    stderr_bytes: int = 64 << 10  # past this the rest is discarded (and counted)
    float_tolerance: float = 1e-9  # relative, for a call test's float values

    def wall_s(self) -> float:
        return self.time_s + self.kill_after_s

    def rlimits(self) -> isolation.Limits:
        return isolation.Limits(memory_bytes=self.memory_bytes, cpu_seconds=max(1, math.ceil(self.time_s)),
                                file_bytes=self.tmp_bytes, processes=self.processes, open_files=self.open_files)


@dataclass(frozen=True)
class TestResult:
    """One test's run. `actual`: the program's output (stdin tests), the repr of the call's value
    (call tests), the failed assertion's message (check tests); at most the stdout budget.
    `error`: why it failed, trimmed (the exception line and the program's last frames, or one line
    such as the limit that stopped it). `debug`: the tail of what the program wrote to stderr (a call
    or check test's prints). `discarded_bytes`: output read past the budgets and dropped."""

    __test__ = False  # not a pytest class

    status: str
    actual: str = ""
    error: str = ""
    debug: str = ""
    seconds: float = 0.0
    discarded_bytes: int = 0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class _Run:
    returncode: int
    stdout: bytes
    stderr: bytes
    discarded: int
    killed: str | None  # "timeout", "startup" or "output" when we ended it
    seconds: float


def _read(proc: subprocess.Popen[bytes], stdin: bytes, limits: CodeLimits, began: float, ready: int) -> _Run:
    """Feed stdin, read both pipes within their budgets until both close or the wall-clock deadline,
    killing the sandbox's whole session on the deadline or on too much stdout. The deadline counts
    from `ready` (the launcher's byte, or its end: the sandbox is up), `STARTUP_S` until then."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = began + STARTUP_S
    started: float | None = None
    budgets = {proc.stdout.fileno(): limits.stdout_bytes, proc.stderr.fileno(): limits.stderr_bytes}
    kept: dict[int, bytearray] = {fd: bytearray() for fd in budgets}
    discarded, killed = 0, None
    pending = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    selector = selectors.DefaultSelector()
    selector.register(ready, selectors.EVENT_READ)
    for fd in budgets:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    if pending:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()

    def kill(why: str) -> None:
        nonlocal killed
        if killed is None:
            killed = why
            _kill(proc)

    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                kill("timeout" if started is not None else "startup")
                deadline = float("inf")  # the pipes close now: read what is left
                left = 5.0
            events = selector.select(min(left, 5.0))
            for key, _ in events:
                fd = key.fd
                if fd == ready:
                    selector.unregister(ready)
                    started = time.monotonic()
                    deadline = started + limits.wall_s()
                    continue
                if fd == stdin_fd and not proc.stdin.closed:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed its stdin
                        pending = memoryview(b"")
                    if not pending:
                        selector.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(fd)
                    continue
                room = budgets[fd] - len(kept[fd])
                kept[fd] += chunk[:max(room, 0)]
                if len(chunk) > room:
                    discarded += len(chunk) - max(room, 0)
                    if fd == proc.stdout.fileno():
                        kill("output")
            if killed and not events and deadline == float("inf"):
                break  # killed and nothing more came in 5 s: a pipe held open elsewhere; give up on it
    finally:
        selector.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    ended = _wait(proc, deadline if killed is None else time.monotonic() + 10)
    if ended is None:  # pipes closed but it did not exit in time
        kill("timeout")
        ended = _wait(proc, time.monotonic() + 10)
    return _Run(-signal.SIGKILL if ended is None else ended, bytes(kept[proc.stdout.fileno()]),
                bytes(kept[proc.stderr.fileno()]), discarded, killed, time.monotonic() - (started or began))


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to bwrap's session (it was started in a new one): bwrap and, with its pid namespace's
    first process, everything the program started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _status_of_failure(run: _Run, limits: CodeLimits) -> tuple[str, str] | None:
    """(status, error) when the run did not end normally, else None."""
    stderr = _decode(run.stderr)
    if run.killed == "timeout":
        return "timeout", f"killed at the wall-clock limit ({limits.wall_s():g} s)"
    if run.killed == "startup":
        return "error", f"the sandbox did not start within {STARTUP_S:g} s"
    if run.killed == "output":
        return "limit", f"output limit: more than {limits.stdout_bytes} bytes on stdout"
    code = run.returncode
    signum = code - 128 if code > 128 else (-code if code < 0 else 0)  # bwrap reports a signal as 128 + its number
    cpu_limit = max(1, math.ceil(limits.time_s))
    if signum == signal.SIGXCPU:  # the soft limit; the hard one (a second later) is SIGKILL
        return "timeout", f"CPU time limit ({cpu_limit} s)"
    if signum == signal.SIGXFSZ:
        return "limit", f"file size limit ({limits.tmp_bytes} bytes)"
    tail = error_tail(stderr)
    if code != 0:
        last = tail.splitlines()[-1] if tail else ""
        if last.startswith("MemoryError"):
            return "limit", f"memory limit ({limits.memory_bytes} bytes of address space)\n{tail}".strip()
        if last.startswith(("OSError: [Errno 27]", "OSError: [Errno 28]")):
            return "limit", f"file size limit ({limits.tmp_bytes} bytes in /tmp)\n{tail}".strip()
        if signum and not tail.startswith("Traceback"):
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            return "error", f"killed by {name}"
        return "error", tail or f"exit status {code}"
    return None


def _prepare(scratch: Path, program: str, test: CodeTest) -> list[str]:
    """Write the program (and harness and payload) into scratch; the argv to run inside."""
    (scratch / PROGRAM).write_text(program, encoding="utf-8", errors="surrogatepass")
    python = os.path.realpath(sys.executable)
    if isinstance(test, StdinTest):
        return [python, "-I", "-B", PROGRAM]
    (scratch / _HARNESS).write_text(_HARNESS_CODE)
    if isinstance(test, CallTest):
        (scratch / _PAYLOAD).write_text(test.call)
        return [python, "-I", "-B", _HARNESS, "call"]
    (scratch / _PAYLOAD).write_text(test.check)
    return [python, "-I", "-B", _HARNESS, "check", test.entry_point]


def _last_json(stdout: bytes) -> dict | None:
    lines = [line for line in _decode(stdout).splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run_test(program: str, test: CodeTest | dict, limits: CodeLimits = CodeLimits()) -> TestResult:
    """Run `program` against one test in a fresh sandbox; never raises for anything the program does."""
    test = parse_test(test)
    reason = isolation.unavailable_reason()
    if reason is not None:
        return TestResult("sandbox_unavailable", error=reason)
    scratch = Path(tempfile.mkdtemp(prefix="selfopd-code-"))
    began = time.monotonic()
    try:
        argv = _prepare(scratch, program, test)
        scratch.chmod(0o755)  # read-only inside, and the program's uid is not ours (root callers)
        stdin = test.stdin.encode("utf-8", errors="surrogatepass") if isinstance(test, StdinTest) else b""
        ready, ready_w = os.pipe()
        try:
            seccomp = isolation.seccomp_fd()
            command = isolation.sandbox_command(argv, scratch, limits=limits.rlimits(), env=PROGRAM_ENV,
                                                scratch_read_only=True, tmp_bytes=limits.tmp_bytes or None,
                                                ready_fd=ready_w, seccomp_fd=seccomp)
            began = time.monotonic()
            try:
                proc = isolation.popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True, env={}, close_fds=True,
                                       pass_fds=(ready_w,) if seccomp is None else (ready_w, seccomp))
            finally:
                os.close(ready_w)
                if seccomp is not None:
                    os.close(seccomp)
            run = _read(proc, stdin, limits, began, ready)
        finally:
            os.close(ready)
    except OSError as e:
        return TestResult("error", error=f"the sandbox could not be started: {e}", seconds=time.monotonic() - began)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _judge(test, run, limits)


def _judge(test: CodeTest, run: _Run, limits: CodeLimits) -> TestResult:
    stderr = _decode(run.stderr)
    debug = stderr[-2000:]
    common = {"seconds": run.seconds, "discarded_bytes": run.discarded}
    failure = _status_of_failure(run, limits)
    if isinstance(test, StdinTest):
        actual = _decode(run.stdout)
        if failure is not None:
            return TestResult(failure[0], actual=actual, error=failure[1], debug=debug, **common)
        status = "passed" if same_output(actual, test.stdout) else "wrong"
        return TestResult(status, actual=actual, debug=debug, **common)
    if failure is not None:
        return TestResult(failure[0], error=failure[1], debug=debug, **common)
    result = _last_json(run.stdout)
    if result is None:
        return TestResult("error", actual=_decode(run.stdout)[-2000:], debug=debug,
                          error="the program ended before the test ran (it exited or closed its output)", **common)
    if isinstance(test, CheckTest):
        if result.get("passed") is True:
            return TestResult("passed", debug=debug, **common)
        return TestResult("wrong", actual=str(result.get("assertion", "")), error="an assertion of check() failed",
                          debug=debug, **common)
    shown = result.get("repr")
    if not isinstance(shown, str):
        return TestResult("error", error="the harness's result line was not a repr", debug=debug, **common)
    try:
        value = ast.literal_eval(shown)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return TestResult("wrong", actual=shown, debug=debug, **common)  # not a literal: cannot equal one
    passed = same_value(value, test.value, limits.float_tolerance)
    return TestResult("passed" if passed else "wrong", actual=shown, debug=debug, **common)


def run_tests(program: str, tests: Sequence[CodeTest | dict], limits: CodeLimits = CodeLimits(),
              workers: int = 2) -> list[TestResult]:
    """`program` against each test, each in its own sandbox, up to `workers` at once; results in test order."""
    parsed = [parse_test(test, f"tests[{i}]") for i, test in enumerate(tests)]
    if not parsed:
        return []
    reason = isolation.unavailable_reason()
    if reason is not None:
        return [TestResult("sandbox_unavailable", error=reason) for _ in parsed]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(parsed))), thread_name_prefix="code-test") as pool:
        return list(pool.map(lambda test: run_test(program, test, limits), parsed))
