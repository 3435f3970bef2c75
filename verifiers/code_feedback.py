"""A program's test results as a reward and as feedback text for a teacher (SDPO's rules).

Which failure the text shows (SDPO, `feedback/code.py`, `format_test_feedback`): the first runtime
error (in test order; a resource limit counts as one), else the first time-out, else the wrong
answers, shortest first by len(input) + len(actual output), at most `max_wrong`. Each field is cut at
`field_chars` (inputs at `input_lines` lines, debug output at `debug_lines`), the whole text at
`total_chars`. All passed: no text.

Only shown tests reach the text. `grade_program` also runs `hidden` tests and returns their pass
fraction beside the shown one's, never their inputs or outputs: a student that learns to print what
the teacher saw passes shown tests and not hidden ones, and the gap shows it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .code_runner import CodeLimits, TestResult, run_tests
from .code_tests import CodeTest, describe, parse_tests
from .result import VerifyResult

TRUNCATED = "..."


@dataclass(frozen=True)
class FeedbackRules:
    """SDPO's caps and counts (their defaults)."""

    field_chars: int = 250
    total_chars: int = 2000
    max_wrong: int = 2
    input_lines: int = 8
    debug_lines: int = 10
    max_frames: int = 3


def _cut(text: str, chars: int, lines: int | None = None) -> str:
    if lines is not None:
        split = text.splitlines()
        if len(split) > lines:
            text = "\n".join(split[:lines]) + "\n" + TRUNCATED
    if len(text) > chars:
        text = text[:max(chars - len(TRUNCATED), 0)] + TRUNCATED
    return text


def _error_text(result: TestResult, rules: FeedbackRules) -> str:
    """The error with at most `max_frames` frames of the program (code_runner keeps 3 already)."""
    lines = result.error.splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if len(frames) > rules.max_frames:
        lines = lines[:1] + lines[frames[-rules.max_frames]:] if lines[0].startswith("Traceback") else \
            lines[frames[-rules.max_frames]:]
    return "\n".join(lines)


def feedback_text(tests: Sequence[CodeTest], results: Sequence[TestResult],
                  rules: FeedbackRules = FeedbackRules()) -> str:
    """What a teacher is told about a program's failures on `tests` (shown tests only); "" when all passed."""
    pairs = list(zip(tests, results))
    errors = [(i, t, r) for i, (t, r) in enumerate(pairs) if r.status in ("error", "limit")]
    timeouts = [(i, t, r) for i, (t, r) in enumerate(pairs) if r.status == "timeout"]
    wrong = [(i, t, r) for i, (t, r) in enumerate(pairs) if r.status == "wrong"]

    def field(text: str, lines: int | None = None) -> str:
        return _cut(text, rules.field_chars, lines)

    blocks: list[str] = []
    if errors:
        index, test, result = errors[0]
        title = "Resource limit exceeded" if result.status == "limit" else "Runtime error"
        blocks.append(f"{title} on test {index + 1}:\n{field(_error_text(result, rules))}\n"
                      f"Input:\n{field(describe(test)[0], rules.input_lines)}")
    elif timeouts:
        index, test, result = timeouts[0]
        blocks.append(f"Time limit exceeded on test {index + 1} ({result.error}).\n"
                      f"Input:\n{field(describe(test)[0], rules.input_lines)}")
    elif wrong:
        shortest = sorted(wrong, key=lambda item: (len(describe(item[1])[0]) + len(item[2].actual), item[0]))
        for index, test, result in shortest[:rules.max_wrong]:
            given, expected = describe(test)
            block = (f"Wrong answer on test {index + 1}.\nInput:\n{field(given, rules.input_lines)}\n"
                     f"Output:\n{field(result.actual)}\nExpected:\n{field(expected)}")
            if result.debug.strip():
                block += f"\nDebug output:\n{field(result.debug.strip(), rules.debug_lines)}"
            blocks.append(block)
    return _cut("\n\n".join(blocks), rules.total_chars)


def reward(results: Sequence[TestResult], mode: str = "fraction") -> float:
    """The fraction of tests passed ('fraction') or 1.0 only when every one did ('all'); 0.0 for no tests."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"reward mode must be 'fraction' or 'all', not {mode!r}")
    if not results:
        return 0.0
    passed = sum(r.passed for r in results)
    return passed / len(results) if mode == "fraction" else float(passed == len(results))


@dataclass(frozen=True)
class CodeVerdict:
    """A program graded: reward and counts on shown tests, the feedback text (shown tests only),
    and the hidden tests' pass fraction beside it (None without hidden tests). `unavailable`: why
    nothing ran (no sandbox here), else ""."""

    reward: float
    passed: int
    total: int
    feedback: str
    hidden_reward: float | None = None
    hidden_passed: int = 0
    hidden_total: int = 0
    unavailable: str = ""
    results: tuple[TestResult, ...] = ()
    hidden_results: tuple[TestResult, ...] = ()


def grade_program(program: str, tests: Sequence[CodeTest | dict], hidden: Sequence[CodeTest | dict] = (),
                  limits: CodeLimits = CodeLimits(), rules: FeedbackRules = FeedbackRules(),
                  reward_mode: str = "fraction", workers: int = 2) -> CodeVerdict:
    """Run `program` against shown and hidden tests (one pool); reward and feedback from the shown ones."""
    shown = parse_tests(tests, "tests")
    secret = parse_tests(hidden, "hidden")
    results = run_tests(program, [*shown, *secret], limits, workers)
    shown_results, hidden_results = results[:len(shown)], results[len(shown):]
    unavailable = next((r.error for r in results if r.status == "sandbox_unavailable"), "")
    return CodeVerdict(
        reward=reward(shown_results, reward_mode), passed=sum(r.passed for r in shown_results), total=len(shown),
        feedback="" if unavailable else feedback_text(shown, shown_results, rules),
        hidden_reward=reward(hidden_results, reward_mode) if secret else None,
        hidden_passed=sum(r.passed for r in hidden_results), hidden_total=len(secret), unavailable=unavailable,
        results=tuple(shown_results), hidden_results=tuple(hidden_results))


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str) -> str | None:
    """The longest fenced code block of a completion (SDPO's rule), or None when there is none."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion)]
    return max(blocks, key=len) if blocks else None


ALL_PASSED = "All the tests shown passed."
NO_PROGRAM = "No program was found in the response (a fenced code block)."


def verify_code(text: str, code: dict) -> VerifyResult:
    """A completion of a code task (`meta["code"]`: `tests`, `hidden`) graded by running its program
    in the sandbox: reward is the shown tests' pass fraction, correct when all pass, feedback the
    SDPO-style text (shown tests only), `hidden_reward` the hidden tests'. Nothing runs without a
    sandbox: the result is then unchecked, with the reason."""
    program = extract_program(text)
    if program is None:
        return VerifyResult(0.0, False, None, None, NO_PROGRAM, hidden_reward=0.0 if code.get("hidden") else None)
    verdict = grade_program(program, code.get("tests", ()), code.get("hidden", ()))
    if verdict.unavailable:
        return VerifyResult(0.0, False, program, "code", f"The program could not be run: {verdict.unavailable}",
                            unchecked=True)
    correct = verdict.total > 0 and verdict.passed == verdict.total
    return VerifyResult(verdict.reward, correct, program, "code", verdict.feedback or ALL_PASSED,
                        hidden_reward=verdict.hidden_reward)
