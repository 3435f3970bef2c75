"""Time limits: a pathological answer returns quickly in the main thread, in a thread pool,
and in a (daemonic) worker process, and the worker pool recovers after each kill."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import selfopd.verifiers.timeout
from selfopd.verifiers import (
    CheckTimeout,
    Verdict,
    WorkerError,
    answers_equivalent,
    compare_answers,
    run_in_worker,
    verify,
)

# Passes the cheap pre-screen but makes math-verify work for minutes: only a kill stops it.
SLOW = r"\sqrt{10^{99999}+1}"
LIMIT_S = 1.0
SLACK_S = 1.5  # kill + bookkeeping on a busy 2-core machine (measured: about 0.05 s)


@pytest.fixture(autouse=True)
def warm_workers(monkeypatch):
    """Two started workers, so the time bounds below measure checks, not start-up (a
    replacement for a killed worker imports sympy for a second or more before it serves)."""
    monkeypatch.setattr(selfopd.verifiers.timeout, "MAX_WORKERS", 2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(pool.map(lambda s: run_in_worker("sleep", s, timeout_s=60), [0.3, 0.3])) == [None, None]


def test_round_trip_keeps_python_types():
    assert run_in_worker("echo", {"a": (1, 2), "b": [3]}, timeout_s=30) == {"a": (1, 2), "b": [3]}


def test_kill_and_recover():
    start = time.monotonic()
    with pytest.raises(CheckTimeout):
        run_in_worker("sleep", 60, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - start < 0.5 + SLACK_S
    assert run_in_worker("echo", 1, timeout_s=60) == 1  # a fresh worker took its place


def test_task_errors_are_reported_and_the_worker_survives():
    with pytest.raises(WorkerError, match="KeyError"):
        run_in_worker("no_such_task", timeout_s=30)
    with pytest.raises(ValueError):
        run_in_worker("echo", 1, timeout_s=0)
    assert run_in_worker("echo", 2, timeout_s=30) == 2


def test_slow_check_in_main_thread():
    start = time.monotonic()
    assert compare_answers(SLOW, "5", timeout_s=LIMIT_S) is Verdict.UNCHECKED
    assert LIMIT_S <= time.monotonic() - start < LIMIT_S + SLACK_S
    result = verify(rf"\boxed{{{SLOW}}}", "5", timeout_s=LIMIT_S)
    assert result.unchecked and result.reward == 0.0 and not result.correct
    assert answers_equivalent(r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", timeout_s=30)  # pool recovered


@pytest.mark.parametrize("answer", ["10^{10^{10}}", "9^{9^{9^{9}}}", "100000!", "2^{2^{2^{2^{2^{2}}}}}"])
def test_towers_return_at_once(answer):
    start = time.monotonic()
    assert not answers_equivalent(answer, "5", timeout_s=LIMIT_S)
    assert time.monotonic() - start < 0.5


def test_time_limit_in_a_thread_pool():
    jobs = [SLOW, "10^{10^{10}}", "9^{9^{9^{9}}}", SLOW, r"\frac{2}{4}", "100000!"]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        verdicts = list(pool.map(lambda a: compare_answers(a, "0.5", timeout_s=LIMIT_S), jobs))
    elapsed = time.monotonic() - start
    assert verdicts == [Verdict.UNCHECKED] * 3 + [Verdict.UNCHECKED, Verdict.EQUIVALENT, Verdict.UNCHECKED]
    # Two slow checks on two warm workers run side by side; the rest never reach a worker.
    assert LIMIT_S <= elapsed < LIMIT_S + SLACK_S, elapsed


def test_math_verify_own_timeout_fails_off_the_main_thread():
    """Why the worker exists: math-verify's signal.alarm timeout refuses to run in a thread."""
    from math_verify import parse

    errors = []

    def run():
        try:
            parse("$1$", parsing_timeout=1)
        except ValueError as e:
            errors.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "thread" in errors[0]


def test_callers_sigalrm_timer_is_left_alone():
    """A caller's own SIGALRM timer (pytest-timeout's signal method) survives our checks."""
    previous = signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert answers_equivalent("x^2+2x+1", "(x+1)^2", timeout_s=30)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < remaining <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_time_limit_inside_a_daemonic_worker_process():
    """multiprocessing.Pool workers are daemonic (may not fork children via multiprocessing);
    a forked one also inherits this process's worker pool, which it must not use."""
    ctx = multiprocessing.get_context("fork")
    start = time.monotonic()
    with ctx.Pool(1) as pool:
        slow = pool.apply_async(compare_answers, (SLOW, "5"), {"timeout_s": LIMIT_S})
        fine = pool.apply_async(answers_equivalent, (r"\sqrt{8}", r"2\sqrt{2}"), {"timeout_s": 30})
        assert slow.get(timeout=60) is Verdict.UNCHECKED
        assert fine.get(timeout=60) is True
    assert time.monotonic() - start < 60
    assert run_in_worker("echo", 3, timeout_s=30) == 3  # the parent's pool is untouched
