"""Reference answers and item metadata are data too: a field that a reasoning-gym scorer runs as Python
must read in its task's grammar, or the check refuses the item (unchecked, 0) and no worker sees it."""

from __future__ import annotations

import copy
import logging

import reasoning_gym

from selfopd.verifiers import reasoning_gym_adapter, shutdown_workers, verify_reasoning_gym

# Rebinds sympy.parse_expr to `callable`: no audit event fires, and from then on every answer that
# the worker's polynomial scorer reads compares False == False: 1 (finding 1 of the re-test).
REWIRE = "vars(__import__('sympy')).update(parse_expr=callable)"
PAYLOAD = "__import__('os').system('true')"


def _entry(task: str, seed: int = 3, **config) -> dict:
    return reasoning_gym.create_dataset(task, size=1, seed=seed, **config)[0]


def _poisoned_polynomial(variable: str = REWIRE) -> dict:
    """A real polynomial_multiplication item whose variable name is code: sympy keeps a symbol's text,
    so the generator writes it word for word into the reference answer."""
    return _entry("polynomial_multiplication", variables=(variable,), allow_cross_variable_product=True,
                  allow_multivariate_polynomials=True)


def test_a_reference_that_is_code_cannot_rewire_the_worker():
    poisoned, honest = _poisoned_polynomial(), _entry("polynomial_multiplication")
    assert REWIRE in poisoned["answer"]
    try:
        result = verify_reasoning_gym("<answer>1</answer>", "polynomial_multiplication", poisoned)
        assert verify_reasoning_gym("<answer>1</answer>", "polynomial_multiplication", honest).reward == 0.0
        assert result.unchecked and not result.rejected and result.reward == 0.0 and result.extracted == "1"
    finally:
        shutdown_workers()  # where the worker was rewired, the next test gets a fresh one


def _with(entry: dict, field: str, value) -> dict:
    changed = copy.deepcopy(entry)
    if field == "answer":
        changed["answer"] = value
    else:
        changed["metadata"][field] = value
    return changed


def _hostile_entries() -> list[tuple[str, dict, str]]:
    """(task, entry, the field) for every entry field a scorer feeds to sympy or eval."""
    return [
        ("polynomial_multiplication", _poisoned_polynomial(), "variables"),
        ("polynomial_multiplication", _with(_entry("polynomial_multiplication"), "answer", f"3*{PAYLOAD}"), "answer"),
        ("simple_integration", _with(_entry("simple_integration"), "integrand", PAYLOAD), "integrand"),
        ("intermediate_integration", _with(_entry("intermediate_integration"), "integrand", f"x + {PAYLOAD}"),
         "integrand"),
        ("intermediate_integration", _with(_entry("intermediate_integration"), "variable", "x.real"), "variable"),
        ("bitwise_arithmetic", _with(_entry("bitwise_arithmetic"), "problem", PAYLOAD), "problem"),
        ("bitwise_arithmetic", _with(_entry("bitwise_arithmetic"), "problem", "0x1 << (0x1 << 0x40)"), "problem"),
        ("number_sorting", _with(_entry("number_sorting"), "answer", PAYLOAD), "answer"),
        ("countdown", _with(_entry("countdown"), "numbers", [1, "2"]), "numbers"),
    ]


def test_entry_fields_that_would_run_as_code_never_reach_the_worker(monkeypatch, caplog):
    def no_worker(*args, **kwargs):
        raise AssertionError(f"the worker was asked to score {args}")

    monkeypatch.setattr(reasoning_gym_adapter, "run_in_worker", no_worker)
    for task, entry, field in _hostile_entries():
        answer = "1" if task != "number_sorting" else "['1']"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=reasoning_gym_adapter.__name__):
            result = verify_reasoning_gym(f"<answer>{answer}</answer>", task, entry)
        assert result.unchecked and result.reward == 0.0 and not result.correct, (task, field, result)
        assert field in caplog.text and "not checked" in caplog.text, caplog.text


def test_screen_entry_names_the_field_and_what_is_wrong():
    from selfopd.verifiers.references import screen_entry

    poly = _entry("polynomial_multiplication")
    assert screen_entry("polynomial_multiplication", poly) is None
    assert screen_entry("polynomial_multiplication", _poisoned_polynomial()) == (
        "metadata 'variables' holds \"vars(__import__('sympy')).update(parse_expr=callable)\", not a plain name")
    assert screen_entry("polynomial_multiplication", _with(poly, "answer", f"3*{PAYLOAD}")) == (
        "the reference answer does not read in the task's grammar (character '.' at 18)")
    assert screen_entry("polynomial_multiplication", _with(poly, "answer", 7)) == "the reference answer is not text"
    bitwise = _entry("bitwise_arithmetic")
    assert screen_entry("bitwise_arithmetic", bitwise) is None
    assert screen_entry("bitwise_arithmetic", _with(bitwise, "problem", "(0x10 << 0x3) ** 0x99")) == (
        "metadata 'problem' does not read as integer arithmetic (a power)")
    assert screen_entry("bitwise_arithmetic", _with(bitwise, "problem", "(0x1 << 0x41)")) == (
        "metadata 'problem' does not read as integer arithmetic (a shift by more than 64 or by a computed amount)")
    assert screen_entry("bitwise_arithmetic", _with(bitwise, "problem", "(0x1 + 0x2")) == (
        "metadata 'problem' does not read as integer arithmetic (unclosed parentheses)")
    integral = _entry("simple_integration")
    assert screen_entry("simple_integration", _with(integral, "integrand", "y**2")) == (
        "metadata 'integrand' does not read in the task's grammar (name 'y')")
    assert screen_entry("puzzle24", _with(_entry("puzzle24"), "numbers", [1, 2, True, 4])) == (
        "metadata 'numbers' is not a list of whole numbers")
    assert screen_entry("chain_sum", {"answer": PAYLOAD, "metadata": {}}) is None  # compared as text, never run


def test_an_unevaluated_integral_is_a_reference_but_no_answer():
    """Some intermediate_integration references are sympy's Integral(...): data (the scorer never reads the
    reference), while an answer that is one is rejected (it would restate the question)."""
    from selfopd.verifiers.references import screen_entry
    from selfopd.verifiers.task_grammars import screen_answer

    entry = _entry("intermediate_integration")
    restated = _with(entry, "answer", f"Integral({entry['metadata']['integrand']}, {entry['metadata']['variable']})")
    assert screen_entry("intermediate_integration", restated) is None
    assert screen_answer("intermediate_integration", restated["answer"], restated) == "call of 'Integral'"


def test_composite_items_are_screened_as_their_source_task():
    from selfopd.verifiers.references import screen_entry

    poisoned = _poisoned_polynomial()
    assert screen_entry("composite", poisoned) == screen_entry("polynomial_multiplication", poisoned) is not None
