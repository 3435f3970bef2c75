"""Model-written programs run against tests in a sandbox (`code_runner`), read from task rows
(`code_tests`) and turned into a reward and feedback text (`code_feedback`).

Hostile programs are each contained: one status for the test, and this process (the trainer's
stand-in) goes on. The sandbox tests skip, with the reason, only where no sandbox can start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import selfopd.verifiers.isolation as isolation
from selfopd.verifiers.code_feedback import FeedbackRules, extract_program, feedback_text, grade_program, reward
from selfopd.verifiers.code_runner import CodeLimits, TestResult, run_test, run_tests
from selfopd.verifiers.code_tests import (CallTest, CheckTest, CodeTestError, StdinTest, error_tail, parse_test,
                                          parse_tests, same_output, same_value)

ROOT = Path(__file__).resolve().parents[2]
NEEDS_SANDBOX = pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                   reason=f"no sandbox here: {isolation.unavailable_reason()}")
# 1 s of CPU, 1 GiB, 16 processes; killed at 4 s of wall clock (the default 2 s is tight on a CI machine
# running other tests: a program's own start-up can take that long there)
LIMITS = CodeLimits(kill_after_s=3.0)
ECHO = {"stdin": "", "stdout": ""}


def _one_line(result: TestResult) -> str:
    """The status line a caller would log: one line whatever the program did."""
    line = f"{result.status}: {result.error.splitlines()[-1] if result.error else ''}"
    assert "\n" not in line and len(line) < 400
    return line


def _leftovers() -> list[int]:
    """Host processes still running a sandboxed program (`python -I -B solution.py`); zombies count as gone."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().endswith(b"\0-B\0solution.py\0") \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


# Hostile programs ---------------------------------------------------------------------------------

FORK_BOMB = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(100)
            os._exit(0)
    except OSError:
        time.sleep(100)
"""


@NEEDS_SANDBOX
def test_a_fork_bomb_stops_at_the_process_limit_and_nothing_of_it_outlives_the_kill():
    result = run_test(FORK_BOMB, ECHO, LIMITS)
    assert result.status == "timeout", _one_line(result)
    deadline = time.monotonic() + 10
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers() == []


@NEEDS_SANDBOX
@pytest.mark.parametrize("program", ["chunks = []\nwhile True:\n    chunks.append(bytearray(50_000_000))\n",
                                     "x = [0] * 10**10\n"], ids=["growing", "at-once"])
def test_a_memory_bomb_hits_the_memory_limit(program):
    # time enough to touch 1 GiB on a busy machine: the memory limit is what stops it
    result = run_test(program, ECHO, CodeLimits(time_s=20))
    assert result.status == "limit" and "memory limit" in result.error, _one_line(result)


@NEEDS_SANDBOX
@pytest.mark.parametrize("program", ["while True:\n    pass\n", "import time\ntime.sleep(100)\n"],
                         ids=["infinite-loop", "sleep"])
def test_a_program_that_never_ends_is_killed_at_the_time_limit(program):
    began = time.monotonic()
    result = run_test(program, ECHO, LIMITS)
    assert result.status == "timeout", _one_line(result)
    assert time.monotonic() - began < LIMITS.wall_s() + 5


@NEEDS_SANDBOX
def test_a_socket_to_a_listening_port_on_the_hosts_loopback_fails():
    with socket.create_server(("127.0.0.1", 0)) as server:  # a vLLM server's or the push's port
        port = server.getsockname()[1]
        program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                   "print('connected')\n")
        result = run_test(program, {"stdin": "", "stdout": "connected"}, LIMITS)
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached it
    assert result.status == "error" and "ConnectionRefusedError" in result.error, _one_line(result)


@NEEDS_SANDBOX
def test_a_secret_file_of_the_trainer_is_out_of_sight(tmp_path):
    secret = f"sk-{uuid.uuid4().hex}"
    key_file = tmp_path / "api_key"  # what the vLLM servers' key file is to a program: a host path
    key_file.write_text(secret)
    result = run_test(f"print(open({str(key_file)!r}).read())\n", {"stdin": "", "stdout": secret}, LIMITS)
    assert result.status == "error" and "FileNotFoundError" in result.error, _one_line(result)
    assert secret not in result.actual + result.debug


ENVIRON = """
import glob
for path in ["/proc/%d/environ" % PID, "/proc/self/environ", *glob.glob("/proc/[0-9]*/environ")]:
    try:
        print(path, open(path, "rb").read())
    except OSError as e:
        print(path, type(e).__name__)
"""


@NEEDS_SANDBOX
def test_the_trainers_environment_is_out_of_sight():
    secret = f"s3cret-{uuid.uuid4().hex}"
    # /proc/<pid>/environ shows the environment a process started with: a trainer started with the key.
    trainer = subprocess.Popen(["sleep", "60"], env={**os.environ, "SELFOPD_API_KEY": secret})
    try:
        deadline = time.monotonic() + 10  # until it has exec'd: a plain child of ours can read it
        while secret.encode() not in Path(f"/proc/{trainer.pid}/environ").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert secret.encode() in Path(f"/proc/{trainer.pid}/environ").read_bytes()
        result = run_test(ENVIRON.replace("PID", str(trainer.pid)), ECHO, LIMITS)
    finally:
        trainer.kill()
        trainer.wait()
    assert result.status == "wrong", _one_line(result)  # it ran, and printed what it could see
    assert secret not in result.actual and "SELFOPD" not in result.actual and "/proc/self/environ" in result.actual


@NEEDS_SANDBOX
def test_writes_land_in_a_private_tmp_and_nowhere_else(tmp_path):
    """The host's folders, the program's own scratch folder (read-only: its file and the harness) fail;
    /tmp inside is a small tmpfs of its own that the host never sees."""
    name = f"selfopd-code-{uuid.uuid4().hex}"
    targets = [tmp_path / name, ROOT / name, Path(sys.prefix) / name, Path(f"/scratch/{name}"),
               Path("/scratch/solution.py")]
    program = ("for path in TARGETS:\n    try:\n        open(path, 'a').write('x')\n"
               "        print('written', path)\n    except OSError as e:\n        print(type(e).__name__, path)\n"
               "open('/tmp/NAME', 'w').write('x')\nprint('tmp', open('/tmp/NAME').read())\n"
               "open('/tmp/big', 'w').write('x' * 100_000_000)\n"
               ).replace("TARGETS", repr([str(t) for t in targets])).replace("NAME", name)
    try:
        result = run_test(program, ECHO, LIMITS)
        assert [t for t in targets[:3] if t.exists()] == [] and not (Path("/tmp") / name).exists()
    finally:
        for target in [*targets[:3], Path("/tmp") / name]:
            if target.is_file():
                target.unlink()
    assert result.status == "limit" and "file size limit" in result.error, _one_line(result)  # the 100 MB file
    assert "written" not in result.actual and result.actual.count("Error") == len(targets)
    assert "tmp x" in result.actual


@NEEDS_SANDBOX
@pytest.mark.parametrize("target", ["os.getppid()", "1"], ids=["parent", "pid-1"])
def test_killing_the_parent_or_pid_1_reaches_nothing_outside(target):
    program = f"import os, time\nprint(os.getppid())\nos.kill({target}, 9)\ntime.sleep(0.5)\nprint('alive')\n"
    result = run_test(program, ECHO, LIMITS)
    _one_line(result)  # whatever it did to its own sandbox, one status for it
    assert result.actual.split()[:1] in (["1"], [])  # its parent is the sandbox's pid 1, not us
    assert run_test("print(1)", {"stdin": "", "stdout": "1"}, LIMITS).status == "passed"  # we go on


CTYPES = """
import ctypes, errno, os, threading
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def call(name, *args):
    result = getattr(libc, name)(*args)
    print(name, args[0], result, errno.errorcode.get(ctypes.get_errno()) if result == -1 else "", flush=True)
call("setuid", 0)
call("mount", b"none", b"/usr", b"tmpfs", 0, None)
call("unshare", 0x10000000)  # CLONE_NEWUSER: root inside a namespace of its own
call("syscall", NR_CLONE, 0x10000000 | 17, 0, 0, 0, 0)  # the same through clone
call("syscall", NR_CLONE3, 0, 0)
call("syscall", NR_PTRACE, 16, 1, 0, 0)  # PTRACE_ATTACH to pid 1
call("syscall", NR_BPF, 0, 0, 0)
thread = threading.Thread(target=lambda: print("thread runs", flush=True))  # what programs need still works
thread.start()
thread.join()
ctypes.string_at(0)
"""


@NEEDS_SANDBOX
def test_ctypes_gets_no_privilege_and_a_crash_is_one_status():
    numbers = isolation._SYSCALLS.get("x86_64" if os.uname().machine == "x86_64" else "aarch64")[1]
    program = CTYPES
    for name in ("clone3", "clone", "ptrace", "bpf"):
        program = program.replace(f"NR_{name.upper()}", str(numbers[name]))
    result = run_test(program, ECHO, LIMITS)
    assert result.status == "error" and result.error == "killed by SIGSEGV", _one_line(result)
    calls = {tuple(line.split()[:2]): line.split()[2:] for line in result.actual.splitlines()}
    assert calls[("setuid", "0")] == ["-1", "EPERM"] and calls[("mount", "b'none'")] == ["-1", "EPERM"]
    assert calls[("unshare", "268435456")] == ["-1", "EPERM"]
    if isolation.seccomp_filter() is not None:
        assert calls[("syscall", str(numbers["clone"]))] == ["-1", "EPERM"]
        assert calls[("syscall", str(numbers["clone3"]))] == ["-1", "ENOSYS"]
        assert calls[("syscall", str(numbers["ptrace"]))] == ["-1", "EPERM"]
        assert calls[("syscall", str(numbers["bpf"]))] == ["-1", "EPERM"]
    assert ("thread", "runs") in calls


@pytest.mark.parametrize("arch, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                          ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_the_seccomp_tables_are_the_kernels_numbers(arch, header):
    import re
    if not os.path.exists(header):
        pytest.skip(f"no {header} here (linux-libc-dev)")
    text = Path(header).read_text()
    kernel = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)}
    assert isolation._SYSCALLS[arch][1] == {name: kernel[name] for name in isolation._SYSCALLS[arch][1]}


@NEEDS_SANDBOX
def test_fifty_megabytes_of_stdout_stop_at_the_output_budget():
    began = time.monotonic()
    result = run_test("import sys\nsys.stdout.write('x' * 50_000_000)\n", ECHO, LIMITS)
    assert result.status == "limit" and "output limit" in result.error, _one_line(result)
    assert len(result.actual) == LIMITS.stdout_bytes and result.discarded_bytes > 0
    assert time.monotonic() - began < 10


@NEEDS_SANDBOX
def test_stderr_past_its_budget_is_discarded_and_counted():
    result = run_test("import sys\nsys.stderr.write('e' * 1_000_000)\nprint('ok')\n", {"stdin": "", "stdout": "ok"},
                      LIMITS)
    assert result.status == "passed" and result.discarded_bytes == 1_000_000 - LIMITS.stderr_bytes


@NEEDS_SANDBOX
def test_non_utf8_output_is_a_wrong_answer_not_a_crash():
    result = run_test("import sys\nsys.stdout.buffer.write(b'\\xff\\xfeabc\\x00\\n')\n", {"stdin": "", "stdout": "abc"},
                      LIMITS)
    assert result.status == "wrong" and "\ufffd" in result.actual, _one_line(result)


SNOOP = """
import glob, gc, os, sys
def answer():
    found = []
    def look(text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if isinstance(text, str) and "MARK" in text:
            found.append(text[text.index("MARK"):][:60])
    for path in glob.glob("/scratch/**", recursive=True) + glob.glob("/proc/[0-9]*/cmdline") + \\
            glob.glob("/proc/[0-9]*/environ") + glob.glob("/tmp/**", recursive=True):
        try:
            look(open(path, "rb").read())
        except OSError:
            pass
    frame = sys._getframe()
    while frame is not None:  # the harness's frames: what it holds
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            look(value if isinstance(value, (str, bytes)) else repr(value))
        frame = frame.f_back
    for obj in gc.get_objects():
        look(obj if isinstance(obj, (str, bytes)) else None)
    print(found, file=sys.stderr)
    return next((f for f in found if "expected" in f), "none")
"""


@NEEDS_SANDBOX
def test_a_program_cannot_find_the_expected_value_of_a_call_test():
    mark = f"tok{uuid.uuid4().hex[:12]}"
    expected = f"{mark}-expected"
    result = run_test(SNOOP.replace("MARK", mark), {"call": f"answer()  # {mark}-call", "expected": repr(expected)},
                      LIMITS)
    assert result.status == "wrong" and result.actual == "'none'", _one_line(result)
    assert f"{mark}-call" in result.debug  # it did look: it found the call, which is its input
    assert "-expected" not in result.debug


# Correctness on each test shape ---------------------------------------------------------------------

ADD_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_FUNCTION = "def add(a, b):\n    print('adding', a, b)\n    return a + b\n"
CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0, 'zero'\n"


@NEEDS_SANDBOX
def test_each_test_shape_passes_fails_and_errs():
    tests = [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "  1   2 ", "stdout": "3  \n\n"},
             {"stdin": "1 2", "stdout": "4"}, {"stdin": "x", "stdout": "1"}]
    statuses = [r.status for r in run_tests(ADD_STDIN, tests, LIMITS)]
    assert statuses == ["passed", "passed", "wrong", "error"]

    calls = [{"call": "add(1, 2)", "expected": "3"}, {"call": "add([1], [2.0])", "expected": "[1, 2.0]"},
             {"call": "add(1, 2)", "expected": "4"}, {"call": "add(1, 'x')", "expected": "1"},
             {"call": "sub(1, 2)", "expected": "-1"}]
    results = run_tests(ADD_FUNCTION, calls, LIMITS)
    assert [r.status for r in results] == ["passed", "passed", "wrong", "error", "error"]
    assert results[2].actual == "3" and "adding 1 2" in results[2].debug  # its prints are debug output
    assert results[3].error.splitlines()[-1].startswith("TypeError") and 'solution.py", line 3' in results[3].error
    assert "selfopd_harness" not in results[3].error and "NameError: name 'sub' is not defined" in results[4].error

    checks = [{"check": CHECK, "entry_point": "add"}, {"check": CHECK, "entry_point": "missing"}]
    passing, missing = run_tests(ADD_FUNCTION, checks, LIMITS)
    assert passing.status == "passed" and missing.status == "error" and "AttributeError" in missing.error
    wrong = run_test("def add(a, b):\n    return a + b + (a < 0)\n", checks[0], LIMITS)
    assert wrong.status == "wrong" and wrong.actual == "zero"


@NEEDS_SANDBOX
def test_a_program_that_exits_before_the_call_is_an_error_not_a_pass():
    result = run_test("import os\nos._exit(0)\n", {"call": "f()", "expected": "None"}, LIMITS)
    assert result.status == "error" and "ended before the test ran" in result.error


@NEEDS_SANDBOX
def test_grade_program_reports_shown_and_hidden_tests_apart():
    program = "def add(a, b):\n    return 3 if (a, b) == (1, 2) else 0\n"  # learnt the shown test only
    verdict = grade_program(program, [{"call": "add(1, 2)", "expected": "3"}],
                            hidden=[{"call": "add(2, 2)", "expected": "4"}, {"call": "add(5, 5)", "expected": "10"}],
                            limits=LIMITS)
    assert (verdict.reward, verdict.passed, verdict.total, verdict.feedback) == (1.0, 1, 1, "")
    assert (verdict.hidden_reward, verdict.hidden_passed, verdict.hidden_total) == (0.0, 0, 2)
    failing = grade_program("def add(a, b):\n    return 0\n", [{"call": "add(1, 2)", "expected": "3"}],
                            hidden=[{"call": "add(7, 7)", "expected": "14"}], limits=LIMITS)
    assert failing.reward == 0.0 and "add(1, 2)" in failing.feedback and "add(7, 7)" not in failing.feedback
    assert "14" not in failing.feedback


def test_no_sandbox_runs_nothing_and_says_why(monkeypatch):
    monkeypatch.setattr(isolation, "unavailable_reason", lambda: "bwrap (bubblewrap) is not installed")
    results = run_tests("print(1)", [{"stdin": "", "stdout": "1"}, {"call": "f()", "expected": "1"}])
    missing = ("sandbox_unavailable", "bwrap (bubblewrap) is not installed")
    assert [(r.status, r.error) for r in results] == [missing] * 2
    verdict = grade_program("print(1)", [{"stdin": "", "stdout": "1"}])
    assert verdict.reward == 0.0 and verdict.feedback == "" and verdict.unavailable.startswith("bwrap")


# Test rows -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("row, message", [
    ({"stdin": "1"}, "tests[0]: field 'stdout' is missing (a test has keys stdin + stdout)"),
    ({"stdin": "1", "stdout": 2}, "tests[0]: field 'stdout' must be a string, not int"),
    ({"call": "f(1)", "expected": "3", "x": 1},
     "tests[0]: field 'x' is not expected (a test has keys call + expected)"),
    ({"call": "f(1", "expected": "3"}, "tests[0]: field 'call' is not a Python expression ("),
    ({"call": "1 + 2", "expected": "3"}, "tests[0]: field 'call' must be one function call, like f(1, 2)"),
    ({"call": "f(1)", "expected": "__import__('os')"},
     "tests[0]: field 'expected' is not a Python literal (ValueError)"),
    ({"check": "assert True", "entry_point": "f"}, "tests[0]: field 'check' must define check(candidate)"),
    ({"check": "def check(c): pass", "entry_point": "f()"}, "tests[0]: field 'entry_point' must be a Python name"),
    ({"input": "1", "output": "2"}, "tests[0]: fields ['input', 'output'] match no test shape"),
    ("stdin", "tests[0]: a test is a mapping, not str"),
])
def test_a_malformed_row_is_refused_in_one_line_naming_the_field(row, message):
    with pytest.raises(CodeTestError) as caught:
        parse_tests([row])
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_rows_parse_to_their_shapes_and_expected_values_are_literals():
    stdin, call, check = parse_tests([{"stdin": "1", "stdout": "2"}, {"call": "f(1)", "expected": " [1, (2, 'a')] "},
                                      {"check": CHECK, "entry_point": "add"}])
    assert stdin == StdinTest("1", "2") and isinstance(check, CheckTest)
    assert isinstance(call, CallTest) and call.value == [1, (2, "a")]
    assert parse_test(call) is call
    assert same_output("1  2 \n3\n\n", "1 2\n3") and not same_output("1 2 3", "1 2\n3")
    assert same_value(0.1 + 0.2, 0.3) and not same_value(True, 1) and not same_value((1,), [1])
    assert same_value({"a": [1.0]}, {"a": [1]}) and not same_value("1", 1)


# Feedback text and reward -------------------------------------------------------------------------

def _r(status: str, actual: str = "", error: str = "", debug: str = "") -> TestResult:
    return TestResult(status, actual=actual, error=error, debug=debug)


TESTS = [StdinTest("1 2", "3"), StdinTest("10 20", "30"), StdinTest("5", "5"), CallTest("f(1)", "1", 1)]


def test_the_first_runtime_error_wins_over_timeouts_and_wrong_answers():
    results = [_r("wrong", "4"), _r("timeout", error="killed at the wall-clock limit (2 s)"),
               _r("error", error="Traceback (most recent call last):\n"
                                 "  File \"/scratch/solution.py\", line 1, in <module>\nValueError: bad"),
               _r("limit", error="memory limit (1 bytes of address space)")]
    assert feedback_text(TESTS, results) == ('Runtime error on test 3:\nTraceback (most recent call last):\n'
                                             '  File "/scratch/solution.py", line 1, in <module>\nValueError: bad\n'
                                             'Input:\n5')
    assert feedback_text(TESTS, [_r("passed")] * 3 + [results[3]]) == (
        "Resource limit exceeded on test 4:\nmemory limit (1 bytes of address space)\nInput:\nf(1)")
    assert feedback_text(TESTS, results[:2] + [_r("passed")] * 2) == (
        "Time limit exceeded on test 2 (killed at the wall-clock limit (2 s)).\nInput:\n10 20")


def test_the_two_shortest_wrong_answers_are_shown_by_input_plus_output():
    results = [_r("wrong", "4" * 10), _r("wrong", "31"), _r("wrong", "6", debug="trace\n"), _r("passed")]
    assert feedback_text(TESTS, results) == ("Wrong answer on test 3.\nInput:\n5\nOutput:\n6\nExpected:\n5\n"
                                             "Debug output:\ntrace\n\n"
                                             "Wrong answer on test 2.\nInput:\n10 20\nOutput:\n31\nExpected:\n30")
    assert feedback_text(TESTS, [_r("passed")] * 4) == ""


def test_fields_and_the_whole_text_are_capped():
    tests = [StdinTest("\n".join(str(i) for i in range(20)), "1")]
    rules = FeedbackRules(field_chars=20, input_lines=3, total_chars=60)
    text = feedback_text(tests, [_r("wrong", "y" * 100)], rules)
    assert text == "Wrong answer on test 1.\nInput:\n0\n1\n2\n...\nOutput:\nyyyyyyyy..."  # the whole text cut
    assert len(text) == 60 and len(feedback_text(tests, [_r("wrong", "y" * 10_000)])) <= 2000
    long = feedback_text(tests * 2, [_r("wrong", "z" * 5000)] * 2)
    assert long.count("z" * 247 + "...") == 2 and len(long) <= 2000


def test_reward_is_the_fraction_passed_or_all_or_nothing():
    results = [_r("passed"), _r("wrong"), _r("passed"), _r("timeout")]
    assert reward(results) == 0.5 and reward(results, "all") == 0.0 and reward([_r("passed")], "all") == 1.0
    assert reward([]) == 0.0
    with pytest.raises(ValueError):
        reward(results, "mean")


def test_the_longest_fenced_block_is_the_program_and_a_traceback_keeps_the_programs_frames():
    text = "Try:\n```python\nx = 1\n```\nor\n```\nprint(2)\nprint(3)\n```"
    assert extract_program(text) == "print(2)\nprint(3)\n" and extract_program("no code") is None
    stderr = ('Traceback (most recent call last):\n  File "/scratch/selfopd_harness.py", line 9, in <module>\n'
              '    run()\n  File "/scratch/solution.py", line 2, in f\n    return g()\n'
              '  File "/scratch/solution.py", line 4, in g\n    1 / 0\nZeroDivisionError: division by zero\n')
    assert error_tail(stderr) == ('Traceback (most recent call last):\n  File "/scratch/solution.py", line 2, in f\n'
                                  '    return g()\n  File "/scratch/solution.py", line 4, in g\n    1 / 0\n'
                                  'ZeroDivisionError: division by zero')
    assert error_tail("warning\nlast line\n\n") == "last line"
