"""The reasoning-gym adapter, on real generated items scored by reasoning-gym itself."""

from __future__ import annotations

import time

import pytest
import reasoning_gym

from selfopd.cli import main
from selfopd.data.example import Example
from selfopd.verifiers import verify_example, verify_reasoning_gym
from selfopd.verifiers.reasoning_gym_adapter import answer_for_scorer
from selfopd.verifiers.task_grammars import GRAMMARS


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


# --- answers are data: hostile answers never reach a scorer that would run them -------------
# FILE is where a payload that runs would leave its mark. Shapes: a plain import, sympy's own
# globals, an attribute walk to os.system, a lambda, string tricks (chr, getattr, fullwidth
# letters Python folds into names), exec, a hex-encoded payload.
HOSTILE = [
    "__import__('os').system('touch FILE')",
    "sympify.__globals__['__builtins__']['__import__']('os').system('touch FILE')",
    "[c for c in ().__class__.__bases__[0].__subclasses__() if c.__name__ == '_wrap_close'][0]"
    ".__init__.__globals__['system']('touch FILE')",
    "(lambda: __import__('os').system('touch FILE'))()",
    "getattr(__import__(chr(111) + chr(115)), 'sys' + 'tem')('touch FILE')",
    "__\uff49\uff4d\uff50\uff4f\uff52\uff54__('os').system('touch FILE')",
    "exec(\"import os; os.system('touch FILE')\")",
    "eval(bytes.fromhex('{hex}').decode())",
    "open('FILE', 'w').write('x')",
]
HUGE = ["2**99999999", "9^9^9", "9**9**9", "2**(x*0 + 9**9)", "1+" * 6000 + "1"]


def _payload(shape: str, marker) -> str:
    command = f"__import__('os').system('touch {marker}')"
    return shape.replace("FILE", str(marker)).replace("{hex}", command.encode().hex())


@pytest.mark.parametrize("task", sorted(GRAMMARS))
def test_hostile_answers_are_rejected_with_no_side_effect(task, tmp_path):
    entry = _entries(task)[0]
    example = Example(id=f"{task}/0", prompt=entry["question"], answer=str(entry["answer"]),
                      meta={"reasoning_gym": {"task": task, "config": {}, "entry": entry}})
    for i, shape in enumerate(HOSTILE + HUGE):
        marker = tmp_path / f"ran-{i}"
        completion = f"<answer>{_payload(shape, marker)}</answer>"
        start = time.monotonic()
        results = [verify_reasoning_gym(completion, task, entry), verify_example(completion, example)]
        assert time.monotonic() - start < 5.0, shape
        assert not marker.exists(), f"{task}: {shape} ran"
        for result in results:
            assert result.rejected and result.reward == 0.0 and not result.correct, (shape, result)
            assert "not written in a form this task accepts" in result.feedback


def test_answers_to_tasks_whose_scorers_only_compare_text_pass_unchanged(tmp_path):
    entry = _entries("spell_backward")[0]
    result = verify_reasoning_gym(f"<answer>{_payload(HOSTILE[0], tmp_path / 'ran')}</answer>",
                                  "spell_backward", entry)
    assert not result.rejected and result.reward == 0.0 and not (tmp_path / "ran").exists()


def test_verifier_feedback_prompt_never_evaluates_the_attempt(tmp_path, capsys, monkeypatch):
    """`selfopd prompts render ... --attempt` grades the attempt for the feedback it shows."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line per paragraph: the feedback is not wrapped
    marker = tmp_path / "ran"
    attempt = f"\\boxed{{{_payload(HOSTILE[1], marker)}}}"
    assert main(["prompts", "render", "teacher/verifier_feedback", "--data", "rg:countdown?size=2&seed=1",
                 "--attempt", attempt]) == 0
    assert not marker.exists()
    assert "not written in a form this task accepts" in capsys.readouterr().out
