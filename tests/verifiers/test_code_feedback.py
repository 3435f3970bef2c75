"""A code task graded as selfopd grades any answer (`verifiers.grade`): its program run in the sandbox
against the shown tests (the reward, the feedback) and the hidden ones (reported apart, never shown)."""

from __future__ import annotations

import pytest

from selfopd.data import load_examples
from selfopd.verifiers import Grading, grade, isolation
from selfopd.verifiers.code_feedback import NO_PROGRAM

pytestmark = pytest.mark.skipif(isolation.unavailable_reason() is not None,
                                reason=f"no sandbox here: {isolation.unavailable_reason()}")


@pytest.fixture(scope="module")
def task():
    (example,) = load_examples("codegen?level=1&size=1&seed=0")
    return example


def _fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\n"


def test_the_reference_program_passes_shown_and_hidden_tests(task):
    result = grade(_fenced(task.answer), task)
    assert result.correct and result.reward == 1.0 and result.hidden_reward == 1.0 and result.method == "code"


def test_a_program_that_learned_the_shown_outputs_fails_the_hidden_tests_and_the_feedback_never_shows_them(task):
    code = task.meta["code"]
    entry = code["entry_point"]
    table = {test["call"]: test["expected"] for test in code["tests"]}
    # The student that memorised what the feedback showed: a lookup of the shown calls' outputs.
    lookup = "\n".join(f"    if repr(args) == {repr(repr(_args(call)))}: return {expected}" for call, expected in table.items())
    program = f"def {entry}(*args):\n{lookup}\n    return None\n"
    result = grade(_fenced(program), task)
    assert result.reward == 1.0 and result.hidden_reward < 1.0  # the gap the run reports per step
    wrong = grade(_fenced(f"def {entry}(*args):\n    return None\n"), task)
    assert not wrong.correct and wrong.reward == 0.0
    for test in code["hidden"]:
        assert test["call"] not in wrong.feedback
    assert any(test["call"] in wrong.feedback for test in code["tests"])


def _args(call: str) -> tuple:
    import ast

    return tuple(ast.literal_eval(arg) for arg in ast.parse(call, mode="eval").body.args)


@pytest.mark.parametrize("completion, finish, feedback", [
    ("I would write a loop.", "stop", NO_PROGRAM),
    ("```python\ndef f(", "length", "cut off"),
])
def test_no_program_fails_the_hidden_tests_too(task, completion, finish, feedback):
    result = grade(completion, task, finish_reason=finish, grading=Grading())
    assert result.reward == 0.0 and result.hidden_reward == 0.0 and feedback in result.feedback
