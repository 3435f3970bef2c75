"""Tasks whose reasoning-gym scorer checks less than its puzzle states are checked by the puzzle's
rules (`strict_tasks.py`), and a scan over every task proves no scorer pays an answer to another item."""

from __future__ import annotations

import contextlib
import io
import time
from fractions import Fraction

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from selfopd.verifiers import verify_reasoning_gym


def _entries(task: str, size: int = 4, seed: int = 11, **config) -> list[dict]:
    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    return [dataset[i] for i in range(len(dataset))]


def _reward(task: str, answer: str, entry: dict) -> float:
    return verify_reasoning_gym(f"<answer>{answer}</answer>", task, entry).reward


def _sum(numbers: list[int]) -> str:
    return "(" + "+".join(map(str, numbers)) + ")"


# --- puzzle24 (finding 6): the puzzle's own numbers, each once, exactly 24 -------------------
@pytest.mark.parametrize("cheat", [
    "(2+2)*(3+3)",  # four numbers in range, none of them the puzzle's (its scorer counts, it does not compare)
    "9+9+6.9",  # 24.9: its scorer truncates with int()
    "{numbers}*0e0+24e0",  # exponent literals are no numbers to its scorer's \b\d+\b
])
def test_puzzle24_pays_only_for_the_puzzles_numbers_making_exactly_24(cheat):
    for entry in _entries("puzzle24"):
        answer = cheat.format(numbers=_sum(entry["metadata"]["numbers"]))
        result = verify_reasoning_gym(f"<answer>{answer}</answer>", "puzzle24", entry)
        assert result.reward == 0.0 and not result.correct, (entry["metadata"]["numbers"], answer)
        assert _reward("puzzle24", entry["answer"], entry) == 1.0


def test_puzzle24_takes_any_exact_solution_with_the_puzzles_numbers():
    entry = _entries("puzzle24", size=1, seed=11)[0]
    assert sorted(entry["metadata"]["numbers"]) == [3, 4, 7, 10]
    for right in ("(10 - 7 + 3)*4", "4*(3 + 10 - 7)", "-(7 - 10 - 3)*4"):
        assert _reward("puzzle24", right, entry) == 1.0, right
    for wrong in ("(10 - 7 + 3)*4*1", "10*3 - 7 + 4 - 3*0", "(10 + 7 + 3)/4", "(10 - 7 + 3)**4/54"):
        assert _reward("puzzle24", wrong, entry) == 0.0, wrong  # numbers it was not given, 5, a power


def test_puzzle24_computes_fractions_exactly():
    entry = {"question": "Make 24 using 3, 3, 8, 8.", "answer": "8/(3 - 8/3)",
             "metadata": {"source_dataset": "puzzle24", "numbers": [3, 3, 8, 8]}}
    assert _reward("puzzle24", "8/(3 - 8/3)", entry) == 1.0  # 8 / (1/3): no float rounding in the way
    assert _reward("puzzle24", "8/(3 - 3) + 8", entry) == 0.0  # divides by zero


# --- countdown: the scorer compares floats with np.isclose and reads numbers with a regex -----
def test_countdown_refuses_exponent_literals_that_its_scorer_does_not_count():
    for entry in _entries("countdown"):
        metadata = entry["metadata"]
        cheat = f"{_sum(metadata['numbers'])}*0e0+{metadata['target']}e0"
        assert _reward("countdown", cheat, entry) == 0.0, cheat
        assert _reward("countdown", entry["answer"], entry) == 1.0


def test_countdown_target_is_exact():
    """np.isclose's relative tolerance (1e-5) pays 100001 for a target of 100000."""
    entry = {"question": "Calculate 100000 using all of these numbers: 100, 1000, 3, 3.", "answer": "100*1000*3/3",
             "metadata": {"source_dataset": "countdown", "numbers": [100, 1000, 3, 3], "target": 100000}}
    assert _reward("countdown", "100*1000 + 3/3", entry) == 0.0
    assert _reward("countdown", "100*1000*(3 - 3 + 1)", entry) == 0.0  # a 1 it was not given
    assert _reward("countdown", "100*1000*3/3*3", entry) == 0.0  # 3 used three times
    assert _reward("countdown", "100*1000*3/3", entry) == 1.0


# --- scorers that pay for anything: game_of_life_halting, coin_flip --------------------------
def test_game_of_life_halting_pays_only_its_own_verdict():
    """Its scorer compares bool(answer) with bool(reference): every non-empty text is True."""
    for entry in _entries("game_of_life_halting", size=6):
        other = "False" if entry["answer"] == "True" else "True"
        for wrong in ("banana", other, "0"):
            assert _reward("game_of_life_halting", wrong, entry) == 0.0, (entry["answer"], wrong)
        assert _reward("game_of_life_halting", entry["answer"], entry) == 1.0
        assert _reward("game_of_life_halting", entry["answer"].lower(), entry) == 1.0


def test_coin_flip_pays_the_probability_not_a_prefix_of_it():
    """Its scorer pays (matching prefix) / (shorter length): "0" scores 1 for every probability below 1."""
    entries = _entries("coin_flip", size=6, seed=99)
    assert "e-" in entries[4]["answer"]  # 6.103515625e-05: references of small probabilities have exponents
    for entry in entries:
        assert _reward("coin_flip", "0", entry) == 0.0, entry["answer"]
        assert _reward("coin_flip", entry["answer"], entry) == 1.0
        exact = Fraction(entry["answer"])
        assert _reward("coin_flip", f"{exact.numerator}/{exact.denominator}", entry) == 1.0
        two_digits = f"{float(exact):.2f}"  # its scorer pays a prefix of the reference ("0.10" of 0.109375) in full
        assert _reward("coin_flip", two_digits, entry) == (1.0 if Fraction(two_digits) == exact else 0.0), two_digits
    assert _reward("coin_flip", "0.1094", {**entries[0], "answer": "0.109375"}) == 1.0  # 4 digits: within 0.1%


# --- the scan: no task pays for an answer to another item -------------------------------------
SCAN_ITEMS = 4  # items per task: 12 ordered pairs
SCAN_SEED = 5
# Tasks whose items may have several right answers, so another item's reference can be right here too
# (the scorer checks it against this item: the answer is right, not merely accepted).
MANY_ANSWERS = {
    "n_queens": "any board completing this item's queens is right; another item's board can be one",
    "quantum_lock": "several shortest button sequences reach the target; the scorer simulates this item's buttons",
}
NOT_SCANNED = {
    "composite": "forwards to the scorers of its source tasks, each scanned here",
}


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(set(DATASETS) - set(NOT_SCANNED)))
def test_no_task_pays_for_an_answer_to_another_item(task):
    """Item i's reference scored on item j (j != i, the references differ) through selfopd's own path must
    score 0: a scorer that pays it does not check the item's inputs, and RL will find that out."""
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # some scorers print what they reject
        entries = _entries(task, size=SCAN_ITEMS, seed=SCAN_SEED)
        paid = [(i, j) for i, a in enumerate(entries) for j, b in enumerate(entries)
                if i != j and str(a["answer"]).strip() != str(b["answer"]).strip()
                and _reward(task, str(a["answer"]), b) == 1.0]
    if task in MANY_ANSWERS:
        return
    assert not paid, f"{task}: item i's reference pays 1 on item j for (i, j) in {paid}"
    assert time.monotonic() - started < 30
