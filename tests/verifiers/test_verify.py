"""verify() and verify_example(): reward, extraction record, and leak-free feedback."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from selfopd.data.example import Example
from selfopd.verifiers import VerifyResult, reference_answer, verify, verify_example

CASES = [
    # (completion, reference, correct, extracted, method)
    (r"... so the answer is $\boxed{\frac{1}{\sqrt{2}}}$.", r"\frac{\sqrt{2}}{2}", True, r"\frac{1}{\sqrt{2}}", "boxed"),
    (r"\boxed{12}", "120", False, "12", "boxed"),
    (r"\boxed{3} no wait \boxed{4}", "4", True, "4", "boxed"),
    (r"\boxed{3} no wait \boxed{4}", "3", False, "4", "boxed"),
    (r"the result is \boxed{-1}", "1", False, "-1", "boxed"),
    (r"cut off \boxed{\frac{3}{4", "4", True, "4", "last_number"),
    (r"\boxed{} and then 7", "7", True, "7", "last_number"),
    ("Answer: 1,234", "1234", True, "1,234", "answer_line"),
    ("Final Answer: $x = 3$", "3", True, "$x = 3$", "answer_line"),
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", True, "12", "gsm8k"),
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "120", False, "12", "gsm8k"),
    ("12 + 7 = 19", "19", True, "19", "last_number"),
    ("It drops to -5.", "-5", True, "-5", "last_number"),
    ("It drops to -5.", "5", False, "-5", "last_number"),
    ("<answer>50%</answer>", r"50\%", True, "50%", "answer_tag"),
    (r"\boxed{(1,2)}", "(2,1)", False, "(1,2)", "boxed"),
    # references given as whole solutions
    (r"\boxed{18}", "Janet has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", True, "18", "boxed"),
    ("Answer: 5", r"We get $\boxed{5}$.", True, "5", "answer_line"),
]


@pytest.mark.parametrize("completion, reference, correct, extracted, method", CASES)
def test_verify(completion, reference, correct, extracted, method):
    result = verify(completion, reference)
    assert result.correct is correct
    assert result.reward == (1.0 if correct else 0.0)
    assert (result.extracted, result.method) == (extracted, method)
    assert not result.unchecked
    assert result.feedback == f"Your final answer {extracted} is {'correct' if correct else 'wrong'}."


def test_no_answer():
    result = verify("I am not sure how to solve this.", "42")
    assert result == VerifyResult(0.0, False, None, None, "No final answer was found in the response.")


def test_pathological_answer_is_unchecked_and_quick():
    result = verify(r"\boxed{9^{9^{9^{9}}}}", "5")
    assert (result.reward, result.correct, result.unchecked) == (0.0, False, True)
    assert result.extracted == "9^{9^{9^{9}}}"
    assert "could not be checked" in result.feedback


def test_result_is_frozen():
    result = verify(r"\boxed{1}", "1")
    with pytest.raises(AttributeError):
        result.reward = 0.5  # type: ignore[misc]


LEAK_CASES = [
    (r"\boxed{7}", "42"),
    (r"\boxed{120}", "12"),  # the reference is a substring of the answer, not a token of it
    ("Answer: 12", "120"),
    ("no idea", "42"),
    ("no idea", r"\frac{1}{2}"),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"),
    ("#### 5", "-5"),
    ("<answer>hello</answer>", "olleh"),
    (r"\boxed{" + "9" * 300 + "}", "8"),
]


@pytest.mark.parametrize("completion, reference", LEAK_CASES)
def test_feedback_never_contains_the_reference(completion, reference):
    result = verify(completion, reference)
    assert not result.correct
    token = re.compile(r"(?<![\w\\.{-])" + re.escape(reference) + r"(?![\w}])")
    assert not token.search(result.feedback), result.feedback
    assert "\n" not in result.feedback
    assert len(result.feedback) <= 160
    assert result.feedback.endswith(".")


def test_feedback_quotes_long_answers_shortened():
    result = verify(r"\boxed{" + "9" * 300 + "}", "8")
    assert result.extracted == "9" * 300
    assert "..." in result.feedback and len(result.feedback) < 120


@pytest.mark.parametrize(
    "reference, expected",
    [(r"so $\boxed{5}$", "5"), ("work\n#### 72", "72"), ("3/4", "3/4"), (r"\boxed{\{1,2\}}", r"\{1,2\}"),
     (r"cut off \boxed{\frac{3}{4", "4")],  # a box that never closes: read as a completion is
)
def test_reference_answer(reference, expected):
    assert reference_answer(reference) == expected


def test_verify_example_uses_answer_without_reasoning_gym_meta():
    example = Example(id="e1", prompt="What is 6 * 7?", answer="42", meta={"source": "test"})
    assert verify_example(r"\boxed{42}", example).correct
    assert not verify_example(r"\boxed{24}", example).correct
    duck = SimpleNamespace(answer="0.75", meta={})
    assert verify_example("Answer: 3/4", duck).correct
    no_meta = SimpleNamespace(answer="1", meta=None)
    assert verify_example("Answer: 1", no_meta).correct


def test_verify_example_ignores_malformed_reasoning_gym_meta():
    example = SimpleNamespace(answer="5", meta={"reasoning_gym": "chain_sum"})
    assert verify_example("Answer: 5", example).correct
