"""The reasoning-gym adapter, on real generated items scored by reasoning-gym itself."""

from __future__ import annotations

import pytest

from selfopd.data.example import Example
from selfopd.verifiers import verify_example, verify_reasoning_gym
from selfopd.verifiers.reasoning_gym_adapter import answer_for_scorer

reasoning_gym = pytest.importorskip("reasoning_gym")


def _entries(task: str, **config):
    dataset = reasoning_gym.create_dataset(task, size=4, seed=7, **config)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic"])
@pytest.mark.parametrize(
    "wrap, method",
    [("Let me think. <answer>{}</answer>", "answer_tag"), ("So the result is $\\boxed{{{}}}$.", "boxed"),
     ("Working...\nAnswer: {}", "answer_line")],
)
def test_correct_answers_score_one(task, wrap, method):
    for entry in _entries(task):
        result = verify_reasoning_gym(wrap.format(entry["answer"]), task, entry)
        assert result.correct and result.reward == 1.0, (entry["question"], entry["answer"], result)
        assert result.method == method
        assert result.extracted == entry["answer"]


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic"])
def test_wrong_answers_score_zero(task):
    for entry in _entries(task):
        wrong = str(int(float(entry["answer"])) + 1)
        result = verify_reasoning_gym(f"<answer>{wrong}</answer>", task, entry)
        assert not result.correct and result.reward == 0.0
        assert result.feedback == f"Your final answer {wrong} is wrong."
        assert not result.unchecked


def test_string_task_and_partial_credit_only_when_asked():
    entry = _entries("spell_backward")[0]
    word = entry["answer"]
    assert verify_reasoning_gym(rf"\boxed{{\text{{{word}}}}}", "spell_backward", entry).correct
    near = word[:-1] + ("x" if word[-1] != "x" else "y")
    exact = verify_reasoning_gym(f"<answer>{near}</answer>", "spell_backward", entry)
    assert exact.reward == 0.0 and not exact.correct and exact.feedback == f"Your final answer {near} is wrong."
    partial = verify_reasoning_gym(f"<answer>{near}</answer>", "spell_backward", entry, partial_credit=True)
    assert 0.0 < partial.reward < 1.0 and not partial.correct
    assert "partly correct" in partial.feedback and word not in partial.feedback


def _chain_sum_example(answer: str) -> Example:
    entry = {"question": "State the final answer to the following arithmetic problem: 3 + 4 =", "answer": answer,
             "metadata": {}}
    return Example(id="chain_sum/x", prompt=entry["question"], answer=answer,
                   meta={"reasoning_gym": {"task": "chain_sum", "config": {}, "entry": entry}})


@pytest.mark.parametrize(
    "completion, reward, partial",
    [
        # reasoning-gym's chain_sum scorer pays 0.5 for these wrong answers; the reward must not.
        ("The answer is 17.", 0.0, 0.5),
        ("The answer is -7.", 0.0, 0.5),
        ("The answer is 7.", 1.0, 1.0),
        # a worked equation states its right-hand side
        ("The answer is 3 + 4 = 7", 1.0, 1.0),
        ("The answer is 3 + 4 = 8.", 0.0, 0.0),
        ("3 + 4 = 7", 1.0, 1.0),
    ],
)
def test_reward_is_exact_unless_partial_credit_is_asked_for(completion, reward, partial):
    example = _chain_sum_example("7")
    exact = verify_example(completion, example)
    assert exact.reward == reward and exact.correct == (reward == 1.0)
    assert verify_example(completion, example, partial_credit=True).reward == pytest.approx(partial)


def test_no_answer_and_pathological_answer():
    entry = _entries("chain_sum")[0]
    assert verify_reasoning_gym("I give up.", "chain_sum", entry).feedback == "No final answer was found in the response."
    tower = verify_reasoning_gym("<answer>9**9**9**9</answer>", "chain_sum", entry)
    assert tower.unchecked and tower.reward == 0.0


def test_unknown_task_is_an_error_not_a_zero():
    entry = _entries("chain_sum")[0]
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chain_summ'"):
        verify_reasoning_gym("<answer>1</answer>", "chain_summ", entry)


def test_verify_example_dispatches_to_reasoning_gym():
    entry = _entries("chain_sum")[1]
    example = Example(
        id="chain_sum/0", prompt=entry["question"], answer=entry["answer"],
        meta={"reasoning_gym": {"task": "chain_sum", "config": {}, "entry": entry}},
    )
    assert verify_example(f"<answer>{entry['answer']}</answer>", example).correct
    # reasoning-gym's own rule decides, not our normaliser (which would drop " apples").
    assert verify_example(f"<answer>{entry['answer']} apples</answer>", example).reward < 1.0


@pytest.mark.parametrize(
    "extracted, expected",
    [(r"$-4$", "-4"), (r"\text{olleh}", "olleh"), ("hello world", "hello world"), (r"\frac{1}{2}", r"\frac{1}{2}")],
)
def test_answer_for_scorer(extracted, expected):
    assert answer_for_scorer(extracted) == expected
