"""Property and fuzz tests: no string makes the verifier raise or hang.

Two halves with different guarantees, tested differently:
- what runs in the caller's process (extraction, normalisation, plain numbers, the
  pre-screen) has no time limit at all, so it must be total and fast on any text: many
  generated strings, each timed;
- what may be slow (math-verify) runs in a killable worker under `timeout_s`: hostile LaTeX
  (power towers, huge factorials, deep nesting) is timed end to end against that limit.
"""

from __future__ import annotations

import time

import pytest
import reasoning_gym
from hypothesis import example, given
from hypothesis import strategies as st

from selfopd.data.example import Example
from selfopd.verifiers import (
    Verdict,
    VerifyResult,
    compare_answers,
    extract_answer,
    normalize_answer,
    run_in_worker,
    verify,
    verify_example,
    verify_reasoning_gym,
)
from selfopd.verifiers.numeric import parse_plain_number
from selfopd.verifiers.prescreen import too_costly
from tests.fuzz_settings import examples

LIMIT_S = 1.0  # the verifier's time limit in these tests
SLACK_S = 1.5  # kill, replacement start and bookkeeping on a busy 2-core machine
IN_PROCESS_S = 2.0  # CPU seconds of the unguarded in-process steps on one string (measured: < 0.6 s, most < 0.01 s)

# --- strategies ----------------------------------------------------------------------------
numbers = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(str),
    st.sampled_from(["0", "1", "-1", "1e999", "1e-999", "1,234", "3/4", "0/0", "1/0", "50%", ".5", "-0",
                     "9" * 5000]),  # more digits than int() reads
)
symbols = st.sampled_from(["x", "y", "e", "i", "\\pi", "\\infty", "oo", "n", "\\alpha", "\\emptyset"])
junk = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["\x00", "{", "}", "\\", "$", "^", "**", "!", "#", "%", "\\{", "\\}", "\u2212", "\u221a",
                     "\U0001f600", "\u202e", "\\left(", "\\right)", "\n", "&", "_", "\\\\"]),
)
leaves = st.one_of(numbers, symbols, junk)


def _wrap(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """LaTeX-ish constructs over smaller pieces, the shapes models write (and break)."""
    pair = st.tuples(children, children)
    return st.one_of(
        children.map(lambda a: f"\\boxed{{{a}}}"),
        children.map(lambda a: f"\\sqrt{{{a}}}"),
        children.map(lambda a: f"{{{a}}}"),
        children.map(lambda a: f"({a})"),
        children.map(lambda a: f"{a}!"),
        children.map(lambda a: f"\\text{{{a}}}"),
        children.map(lambda a: f"\\left( {a} \\right)"),
        pair.map(lambda p: f"\\frac{{{p[0]}}}{{{p[1]}}}"),
        pair.map(lambda p: f"{p[0]}^{p[1]}"),
        pair.map(lambda p: f"{p[0]}^{{{p[1]}}}"),
        pair.map(lambda p: f"{p[0]}**{p[1]}"),
        pair.map(lambda p: f"{p[0]}+{p[1]}"),
        pair.map(lambda p: f"{p[0]} = {p[1]}"),
        pair.map(lambda p: f"{p[0]}, {p[1]}"),
        pair.map(lambda p: f"\\{{{p[0]}, {p[1]}\\}}"),
        pair.map(lambda p: f"\\binom{{{p[0]}}}{{{p[1]}}}"),
        pair.map(lambda p: "".join(p)),  # glued: unbalanced braces meet their partners
    )


latex_ish = st.recursive(leaves, _wrap, max_leaves=12)
completions = st.one_of(
    st.text(),
    latex_ish,
    st.tuples(st.text(max_size=30), latex_ish, st.sampled_from(
        ["\\boxed{%s}", "<answer>%s</answer>", "Answer: %s", "The final answer is %s.", "#### %s", "%s"]),
    ).map(lambda t: t[0] + t[2].replace("%s", t[1])),
)


def _timed(fn, *args, setup: str | None = None, **kwargs):
    """(result, seconds) of one call, after a warm-up that waits for a worker to be ready:
    a replacement for a killed worker imports sympy (and `setup`'s module) first, which the
    limit does not cover."""
    run_in_worker("echo", None, timeout_s=60, setup=setup)
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


def _check_result(result: VerifyResult) -> None:
    assert isinstance(result, VerifyResult)
    assert 0.0 <= result.reward <= 1.0
    assert result.correct == (result.reward == 1.0)
    assert not (result.unchecked and result.reward) and not (result.rejected and result.reward)
    assert (result.extracted is None) == (result.method is None)
    assert "\n" not in result.feedback


# --- the in-process steps: total and fast --------------------------------------------------
@examples(400)
@given(completions)
@example("\\boxed{" + "1" * 5000 + "}")  # more digits than int() reads: was a ValueError
@example("the answer is " * 4000)  # one runaway line: was quadratic (6 s), now linear (0.5 s)
@example("2^" * 499 + "2")
@example("\\boxed{" * 5000)
@example("{" * 3000 + "}" * 3000)
def test_in_process_steps_never_raise_and_stay_fast(text):
    # This thread's CPU time, not the wall clock: a busy machine (the suite's other worker, vLLM servers) once
    # stretched 0.6 s of work to 4 s of wall time; runaway (quadratic) work still shows in CPU time.
    start = time.thread_time()
    found = extract_answer(text)
    for answer in ([found.text] if found else []) + [text]:
        normalized = normalize_answer(answer)
        parse_plain_number(normalized)
        reason = too_costly(normalized)
        assert reason is None or isinstance(reason, str)
    assert time.thread_time() - start < IN_PROCESS_S


# --- end to end: never raises, returns within the limit ------------------------------------
@examples(40)
@given(completions, st.one_of(latex_ish, numbers))
@example("\\boxed{" + "1" * 5000 + "}", "2")  # int() of 5000 digits raised ValueError
@example("\\boxed{1/" + "7" * 5000 + "}", "\\frac{1}{2}")
@example("\x00\\boxed{\x00}", "\x00")
def test_verify_never_raises_and_returns_within_its_limit(completion, reference):
    result, seconds = _timed(verify, completion, reference, timeout_s=LIMIT_S)
    _check_result(result)
    assert seconds < LIMIT_S + SLACK_S


@examples(60)
@given(latex_ish)
@example("0=0")  # a reference "\\boxed{3+4=7}" was not read as 7, the same completion as 7: wrong
def test_an_answer_is_equivalent_to_itself(answer):
    """Also through extraction: a reference written as a boxed solution grades the same
    boxed completion correct, unless the box holds no answer at all."""
    if normalize_answer(answer):
        assert compare_answers(answer, answer, timeout_s=LIMIT_S) is Verdict.EQUIVALENT
    boxed = f"\\boxed{{{answer}}}"
    found = extract_answer(boxed)
    if found is not None and normalize_answer(found.text):
        assert verify(f"so {boxed}", boxed, timeout_s=LIMIT_S).correct


HOSTILE = [
    "9^9^9^9", "9^{9^{9^{9}}}", "9**9**9**9", "10^10^10", "10^{10^{10}}", "10^{-10^{10}}", "2^{2^{2^{2^{2^{2}}}}}",
    "99999^{99999}", "(2^{100000})^{100000}", "(1+x)^{100000}", "e^{e^{e^{e^{100}}}}", "x^{x^{x^{x^{x}}}}",
    "100000!", "(10^{10})!", "((10!)!)!", "\\Gamma(10^{10})", "\\binom{10^{10}}{5000}", "\\sqrt{10^{99999}+1}",
    "\\sqrt{" * 200 + "2" + "}" * 200, "(" * 300 + "1" + ")" * 300, "{" * 3000 + "}" * 3000, "1+" * 400 + "1",
    "\\sum_{n=1}^{10^{10}} n", "\\int_0^1 e^{-x^{1000000}} dx", "\\frac{" * 100 + "1" + "}{2}" * 100,
    "2" * 900 + "!", "1" * 5000, "\x00" * 100, "\\" * 1000,
]


@pytest.mark.parametrize("answer", HOSTILE, ids=lambda a: repr(a[:24]))
def test_hostile_latex_returns_within_the_time_limit(answer):
    for call in (lambda: verify(f"\\boxed{{{answer}}}", "2", timeout_s=LIMIT_S),
                 lambda: verify_example(f"Answer: {answer}", Example(id="h", prompt="?", answer="1/2"),
                                        timeout_s=LIMIT_S)):
        result, seconds = _timed(call)
        _check_result(result)
        assert seconds < LIMIT_S + SLACK_S, f"{answer[:40]!r} took {seconds:.2f} s"


@pytest.fixture(scope="module")
def arithmetic_entry():
    return reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=7)[0]


@examples(25)
@given(completions)
@example("<answer>9**9**9**9</answer>")
@example("<answer>" + "9" * 5000 + "</answer>")
def test_reasoning_gym_scoring_never_raises_and_returns_within_its_limit(arithmetic_entry, completion):
    result, seconds = _timed(verify_reasoning_gym, completion, "basic_arithmetic", arithmetic_entry,
                             timeout_s=LIMIT_S, partial_credit=True, setup="import_reasoning_gym")
    _check_result(result)
    assert seconds < LIMIT_S + SLACK_S
