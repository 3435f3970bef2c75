"""Generated worked solutions: every step is true arithmetic, the digits written spell the
answer, the last line is the student's answer format, and the data loader attaches them."""

from __future__ import annotations

import random
import re

import pytest

from selfopd.data import load_examples
from selfopd.data.worked_solutions import arithmetic_solution

STEP = re.compile(r"(?P<parts>[\d +*]+?) = (?P<total>\d+), write (?P<digit>\d)(?:, carry (?P<carry>\d+))?")


def _check_steps(text: str) -> None:
    """Each 'a op b (+ c) = t, write d, carry k' is arithmetically right."""
    for match in STEP.finditer(text):
        total = eval(match["parts"])  # digits, + and * only (the regex admits nothing else)
        assert total == int(match["total"]), match.group(0)
        assert int(match["digit"]) == total % 10 and int(match["carry"] or 0) == total // 10, match.group(0)


@pytest.mark.parametrize("operator", ["+", "*"])
def test_every_step_is_right_and_the_last_line_is_the_answer(operator):
    rng = random.Random(0)
    for _ in range(400):
        terms = [rng.randint(0, 10 ** rng.randint(1, 4)) for _ in range(rng.choice([2, 3] if operator == "+" else [2]))]
        expression = f" {operator} ".join(map(str, terms))
        solution = arithmetic_solution(expression)
        value = eval(expression)
        assert solution.splitlines()[-1] == f"So {expression} = {value}.", solution
        _check_steps(solution)
        if operator == "+":  # the digits written, read from the last column back, are the sum
            written = []
            for line in solution.splitlines()[:-1]:
                carried = re.search(r"write the carry (\d+)", line)
                written.append(carried[1] if carried else re.search(r"write (\d)", line)[1])
            assert "".join(reversed(written)) == str(value), solution


def test_what_is_not_a_plain_sum_or_product_gets_no_solution():
    for expression in ("3 - 2", "-4 + 5", "(1 + 2) * 3", "6 / 2", "2 * 3 * 4"):
        assert arithmetic_solution(expression) is None, expression


def test_the_demo_task_and_multiplication_items_carry_solutions():
    demo = load_examples("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+"
                         "&allow_negation=false&allow_parentheses=false&size=50&seed=1")
    assert all(e.solution and e.solution.endswith(f"= {e.answer}.") for e in demo)
    products = load_examples("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=*"
                             "&allow_negation=false&allow_parentheses=false&size=20&seed=1")
    assert all(e.solution and e.solution.endswith(f"= {e.answer}.") for e in products)
