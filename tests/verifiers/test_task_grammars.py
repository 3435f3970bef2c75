"""The per-task grammars against the installed reasoning-gym: every scorer that evaluates text
has one, and none refuses reasoning-gym's own answers or items (a grammar too strict is a defect)."""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
import types

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from selfopd.verifiers import verify_reasoning_gym
from selfopd.verifiers.references import screen_entry
from selfopd.verifiers.task_grammars import GRAMMARS, grammar_for, screen_answer

EVALUATORS = re.compile(r"\b(eval|exec|compile|sympify|parse_expr|parse_latex|literal_eval|simplify|lambdify|S)\s*\(")
SEEDS = 20  # reasoning-gym's own answers checked per task


def _sources(fn: types.FunctionType, cls: type, seen: set) -> list[str]:
    """The source of `fn` and of every function of its class or module it calls, transitively."""
    fn = inspect.unwrap(fn)
    if fn in seen:
        return []
    seen.add(fn)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return []
    found = [source]
    module = sys.modules[fn.__module__]
    for name in re.findall(r"\b([A-Za-z_]\w*)\s*\(", source):
        callee = getattr(cls, name, None) or getattr(module, name, None)
        if isinstance(callee, types.FunctionType):
            found += _sources(callee, cls, seen)
    return found


def _evaluates_text(cls: type) -> bool:
    return any(EVALUATORS.search(source) for source in _sources(cls.score_answer, cls, set()))


def test_every_scorer_that_evaluates_text_has_a_grammar():
    """Fails when a reasoning-gym upgrade adds (or drops) a scorer that runs Python on text:
    audit it and give it an entry in task_grammars.GRAMMARS."""
    flagged = {task for task, (cls, _config) in DATASETS.items() if _evaluates_text(cls)}
    assert flagged - set(GRAMMARS) == set(), "scorers that evaluate text without a grammar"
    assert set(GRAMMARS) - flagged == set(), "grammars for scorers that no longer evaluate text: re-audit them"


def _entries(task: str) -> list[dict]:
    dataset = reasoning_gym.create_dataset(task, size=SEEDS, seed=2024)
    return [dataset[i] for i in range(len(dataset))]


def _own_answer(task: str, entry: dict) -> str:
    return entry["metadata"]["valid_answers"][0] if task == "n_queens" else entry["answer"]


@pytest.mark.parametrize("task", sorted(GRAMMARS))
def test_reasoning_gym_own_answers_read_and_score_one(task):
    """Every item's reference answer and metadata pass `references.screen_entry` (the loader and the
    scorer refuse an item that fails it), and its own answer reads and scores 1."""
    checked = 0
    for entry in _entries(task):
        assert screen_entry(task, entry) is None, (entry["answer"], entry["metadata"])
        answer = _own_answer(task, entry)
        if task == "intermediate_integration" and "Integral(" in answer:
            continue  # sympy gave up on this one: not an answer (see the test below)
        assert screen_answer(task, answer, entry) is None, answer
        result = verify_reasoning_gym(f"<answer>{answer}</answer>", task, entry, timeout_s=30)
        assert result.correct and result.reward == 1.0 and not result.rejected, (answer, result)
        checked += 1
    assert checked >= SEEDS * 3 // 4


def test_an_integral_that_restates_the_question_is_no_answer():
    """Some intermediate_integration references are sympy's unevaluated Integral(...); its scorer
    would pay 1 for `Integral(integrand, x) + C` on any item, so the grammar has no Integral."""
    entry = _entries("intermediate_integration")[0]
    metadata = entry["metadata"]
    cheat = f"Integral({metadata['integrand']}, {metadata['variable']}) + C"
    result = verify_reasoning_gym(f"<answer>{cheat}</answer>", "intermediate_integration", entry)
    assert result.rejected and result.reward == 0.0


def test_variables_come_from_the_entry_and_must_be_plain_names():
    entry = {"metadata": {"variables": ["y", "__class__", "a.b", 3]}}
    assert grammar_for("polynomial_multiplication", entry).names == frozenset({"y"})
    assert screen_answer("polynomial_multiplication", "3*y**2", entry) is None
    assert screen_answer("polynomial_multiplication", "3*x**2", entry) == "name 'x'"
    assert grammar_for("chain_sum", entry) is None and screen_answer("chain_sum", "__import__", entry) is None


def test_composite_items_take_their_source_task_grammar():
    entry = {"metadata": {"source_dataset": "countdown"}}
    assert grammar_for("composite", entry) == grammar_for("countdown", entry)
    assert grammar_for("composite", {"metadata": {"source_dataset": "chain_sum"}}) is None
