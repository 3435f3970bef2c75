"""What is graded of a completion: the text after its reasoning block, and only a finished one
(`verifiers/final.py`), on real examples (a plain reference, a reasoning-gym task)."""

from __future__ import annotations

import pytest

from selfopd.data.example import Example
from selfopd.verifiers import Grading, final_text, grade

SEVEN = Example(id="toy/0", prompt="What is 3 + 4?", answer="7")
OFF = Grading(reasoning_start="", reasoning_end="")


def test_only_the_text_after_the_reasoning_block_is_graded():
    assert grade("<think>... the answer is 5</think> The answer is 7", SEVEN).extracted == "7"
    assert grade("<think>... the answer is 5</think> The answer is 7", SEVEN).correct
    # the number written while thinking is not the answer, whatever rule would have found it
    scratch = grade("<think>So the answer is 7.</think>\n\nI get 5", SEVEN)
    assert (scratch.extracted, scratch.correct) == ("5", False)
    assert not grade("<think>\\boxed{7}</think> 5", SEVEN).correct


def test_an_unclosed_reasoning_block_has_no_answer():
    for text in ("<think>... 5", "<think>3 + 4 = 7", "<think>a</think> <think>the answer is 7"):
        result = grade(text, SEVEN)
        assert (result.extracted, result.correct, result.reward) == (None, False, 0.0), text
        assert "ended inside its reasoning" in result.feedback


def test_a_block_the_prompt_opened_needs_its_end():
    """A chat template that opens `<think>` in the generation prompt: the completion starts inside it."""
    assert grade("3 + 4 = 7", SEVEN, opened=True).extracted is None
    assert grade("hmm, 3 + 4 = 5?\n</think>\n\nThe answer is 7", SEVEN, opened=True).correct
    assert Grading().opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Grading().opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not OFF.opens_reasoning("<think>\n")


def test_a_truncated_completion_is_wrong_by_default_and_graded_when_asked():
    text = "To calculate 3 + 4, we add them, which gives 7. This is a classic"
    truncated = grade(text, SEVEN, finish_reason="length")
    assert (truncated.correct, truncated.extracted) == (False, None)
    assert "cut off" in truncated.feedback
    assert grade(text, SEVEN, finish_reason="length", grading=Grading(truncated="grade")).correct
    assert grade(text, SEVEN, finish_reason="stop").correct


def test_a_completion_without_a_reasoning_block_is_graded_as_before():
    """SmolLM2 writes no reasoning block: the whole completion is graded, as `verify_example` does."""
    from selfopd.verifiers import verify_example

    for text in ("3 + 4 = 7", "The answer is 7.", "I think 5", "", "\\boxed{7} or 8", "no number"):
        assert grade(text, SEVEN) == verify_example(text, SEVEN), text
        assert final_text(text) == text
    assert final_text("<think>x</think> 7", OFF) == "<think>x</think> 7"  # delimiters off: read whole


def test_a_reasoning_gym_task_is_graded_on_the_text_after_the_block():
    """The task's own scorer (in the worker) gets only the final answer's text."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    example = Example(id="rg/0", prompt=entry["question"], answer=entry["answer"],
                      meta={"reasoning_gym": {"task": "basic_arithmetic", "config": {}, "entry": entry}})
    wrong = str(int(entry["answer"]) + 1)
    assert grade(f"<think>the answer is {wrong}</think>The answer is {entry['answer']}", example).correct
    assert not grade(f"<think>the answer is {entry['answer']}</think>The answer is {wrong}", example).correct
    assert grade(f"<think>the answer is {entry['answer']}", example).extracted is None


def test_a_truncated_policy_is_one_of_the_two():
    """The delimiters' rules are checked where the settings are read (tests/config/test_verifier.py)."""
    with pytest.raises(ValueError):
        Grading(truncated="maybe")  # type: ignore[arg-type]
