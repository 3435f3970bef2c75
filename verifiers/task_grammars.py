"""Which reasoning-gym tasks run Python on the answer, and the grammar each answer must read in.

Audited in reasoning-gym 0.1.19's scorers (`tests/verifiers/test_task_grammars.py` scans the
installed scorers and fails when one that evaluates text has no entry here):
- sympy `parse_expr` on the answer: countdown, puzzle24, polynomial_multiplication,
  simple_integration, intermediate_integration;
- Python `eval` on the answer when it is not the exact expected text (for partial credit on a
  Python list): binary_matrix, spiral_matrix, string_insertion, n_queens;
- `eval` on the entry's own fields only, the answer read by `json.loads` or `int(s, 0)`:
  number_sorting, bitwise_arithmetic (given a grammar anyway, so a scorer that changes how it
  reads the answer is still covered).
Every other task's scorer compares strings or numbers itself: its answers pass unchanged.
`composite` forwards to the scorer of the entry's source dataset, and so does this table.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .grammar import Expression, Grammar, Integer, Literal, reject_reason

# A variable name that reaches sympy; the data loader holds generator options that name variables to it too.
PLAIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,15}")
# What an antiderivative of reasoning-gym's integrands needs. Not `Integral`: some reference
# answers are sympy's unevaluated Integral(...), and an answer that restates the question as
# Integral(integrand, x) would be scored correct.
ELEMENTARY_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc",
    "sinh", "cosh", "tanh", "coth", "asinh", "acosh", "atanh", "acoth", "exp", "log", "ln", "sqrt", "Abs",
})


def _variables(*names: Any) -> frozenset[str]:
    """The entry's own variable names that are plain names (the entry is the generator's, but a
    name is the one thing here that reaches the parser as code, so it is checked as well)."""
    return frozenset(n for n in names if isinstance(n, str) and PLAIN_NAME.fullmatch(n))


def _integral(metadata: Mapping[str, Any], functions: frozenset[str]) -> Expression:
    return Expression(names=_variables(metadata.get("variable"), "C") | ({"pi", "E"} if functions else set()),
                      functions=functions)


ARITHMETIC = Expression()  # numbers and operators only
GRAMMARS: dict[str, Callable[[Mapping[str, Any]], Grammar]] = {
    "countdown": lambda metadata: ARITHMETIC,
    "puzzle24": lambda metadata: ARITHMETIC,
    "polynomial_multiplication": lambda metadata: Expression(names=_variables(*metadata.get("variables", ()))),
    "simple_integration": lambda metadata: _integral(metadata, frozenset()),
    "intermediate_integration": lambda metadata: _integral(metadata, ELEMENTARY_FUNCTIONS),
    "binary_matrix": lambda metadata: Literal(),
    "spiral_matrix": lambda metadata: Literal(),
    "number_sorting": lambda metadata: Literal(),
    "n_queens": lambda metadata: Literal(words=re.compile(r"Q|_")),
    "string_insertion": lambda metadata: Literal(words=re.compile(r"[A-Z]+")),
    "bitwise_arithmetic": lambda metadata: Integer(),
}


def metadata_of(entry: Any) -> Mapping[str, Any]:
    """The entry's metadata, {} when it has none."""
    metadata = entry.get("metadata") if isinstance(entry, Mapping) else None
    return metadata if isinstance(metadata, Mapping) else {}


def source_task(task: str, entry: Mapping[str, Any]) -> str:
    """The task whose scorer judges `entry`: a composite item's source dataset, else `task`."""
    return str(metadata_of(entry).get("source_dataset")) if task == "composite" else task


def grammar_for(task: str, entry: Mapping[str, Any]) -> Grammar | None:
    """The grammar an answer to `entry` of `task` must read in; None when its scorer runs no Python."""
    rule = GRAMMARS.get(source_task(task, entry))
    return None if rule is None else rule(metadata_of(entry))


def screen_answer(task: str, answer: str, entry: Mapping[str, Any]) -> str | None:
    """Why `answer` may not be handed to `task`'s scorer (a short phrase), or None when it may."""
    grammar = grammar_for(task, entry)
    return None if grammar is None else reject_reason(answer, grammar)
