"""Reference answers and item metadata are data too: they pass a grammar before any scorer sees them.

A reasoning-gym item is made from a data spec's generator options, and some generators copy an option
into the item word for word: polynomial_multiplication's variable names become sympy symbols, whose text
the reference answer then holds (`variables=__import__('os').system(...),`). The scorers that run
Python on an answer (`task_grammars.py`) run it on the item too: polynomial_multiplication parses its
reference with sympy, the integration tasks their integrand, bitwise_arithmetic `eval`s its problem,
number_sorting `eval`s a reference that is not JSON. Code that only rebinds objects passes the worker's
audit hook and would rewire the long-lived worker for every later check, so these fields must read in a
grammar too: `verify_reasoning_gym` leaves an answer to an item that fails unchecked (0, no worker), and
the data loader refuses the item. The reference of every task with a grammar must read in it (else the
item's own right answer would be rejected), except that an intermediate_integration reference may be
sympy's unevaluated `Integral(...)` (its scorer differentiates the answer; it never reads the reference).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from .grammar import MAX_CHARS, MAX_DEPTH, Expression, reject_reason
from .task_grammars import PLAIN_NAME, grammar_for, metadata_of, source_task

MAX_SHIFT = 64  # bitwise_arithmetic shifts by 0 to 3; a shift by 2**40 would allocate terabytes
_INTEGER_TOKEN = re.compile(r"\s+|0[xX][0-9a-fA-F]+|[0-9]+|<<|>>|\*\*|[-+*()]")


def _in_grammar(text: Any, grammar: Any) -> str | None:
    if not isinstance(text, str):
        return "is not text"
    why = reject_reason(text, grammar)
    return None if why is None else f"does not read in the task's grammar ({why})"


def _small_literal(token: str) -> bool:
    """A whole-number literal of at most MAX_SHIFT (a few digits: int() refuses past 4300)."""
    hexadecimal = token.lower().startswith("0x")
    return token[0].isdigit() and len(token) <= 8 and int(token, 16 if hexadecimal else 10) <= MAX_SHIFT


def _integer_arithmetic(text: str) -> str | None:
    """Why `text` is not integer arithmetic that `eval` computes quickly: whole numbers (decimal or 0x),
    + - * << >> and parentheses, every shift by a literal of at most MAX_SHIFT. No name, dot or quote, so
    nothing but arithmetic can be read into it."""
    if len(text) > MAX_CHARS:
        return f"longer than {MAX_CHARS} characters"
    tokens, i, depth = [], 0, 0
    while i < len(text):
        match = _INTEGER_TOKEN.match(text, i)
        if match is None:
            return f"character {text[i]!r} at {i}"
        if not match.group().isspace():
            tokens.append(match.group())
        i = match.end()
    for previous, token in zip([""] + tokens, tokens):
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token == "**":
            return "a power"
        if not 0 <= depth <= MAX_DEPTH:
            return f"unbalanced parentheses or nesting deeper than {MAX_DEPTH}"
        if previous in ("<<", ">>") and not _small_literal(token):
            return f"a shift by more than {MAX_SHIFT} or by a computed amount"
    return "unclosed parentheses" if depth else ("empty" if not tokens else None)


def _metadata(field: str, check: Callable[[Any, Mapping[str, Any], str], str | None]) -> Callable[..., str | None]:
    """A check of metadata `field`, phrased "metadata 'field' ..."."""
    def checked(metadata: Mapping[str, Any], entry: Mapping[str, Any], task: str) -> str | None:
        why = check(metadata.get(field), entry, task)
        return None if why is None else f"metadata {field!r} {why}"
    return checked


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain_names(value: Any, entry: Mapping[str, Any], task: str) -> str | None:
    """Variable names reach sympy as code when they are not plain: checked before anything that holds them."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):  # empty where a product has no variable left
        return "is not a name or a list of names"
    bad = next((n for n in names if not (isinstance(n, str) and PLAIN_NAME.fullmatch(n))), None)
    return None if bad is None else f"holds {_shown(bad)}, not a plain name"


def _integrand(value: Any, entry: Mapping[str, Any], task: str) -> str | None:
    return _in_grammar(value, grammar_for(task, entry))


def _problem(value: Any, entry: Mapping[str, Any], task: str) -> str | None:
    if not isinstance(value, str):
        return "is not text"
    why = _integer_arithmetic(value)
    return None if why is None else f"does not read as integer arithmetic ({why})"


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _numbers(value: Any, entry: Mapping[str, Any], task: str) -> str | None:
    whole = isinstance(value, (list, tuple)) and 0 < len(value) <= 20 and all(map(_whole_number, value))
    return None if whole else "is not a list of whole numbers"


def _target(value: Any, entry: Mapping[str, Any], task: str) -> str | None:
    return None if _whole_number(value) else "is not a whole number"


# The variable names each task's generator writes into its reference or integrand (checked first: the cause).
NAME_CHECKS: dict[str, Callable[..., str | None]] = {
    "polynomial_multiplication": _metadata("variables", _plain_names),
    "simple_integration": _metadata("variable", _plain_names),
    "intermediate_integration": _metadata("variable", _plain_names),
}
# The other metadata each task's scorer (or `strict_tasks.py`) computes with, and how each field must read.
METADATA_CHECKS: dict[str, tuple[Callable[..., str | None], ...]] = {
    "simple_integration": (_metadata("integrand", _integrand),),
    "intermediate_integration": (_metadata("integrand", _integrand),),
    "bitwise_arithmetic": (_metadata("problem", _problem),),
    "countdown": (_metadata("numbers", _numbers), _metadata("target", _target)),
    "puzzle24": (_metadata("numbers", _numbers),),
}


def screen_entry(task: str, entry: Mapping[str, Any]) -> str | None:
    """Why `entry`'s own fields may not be handed to `task`'s scorer (a short phrase), or None when they may."""
    task = source_task(task, entry)
    metadata = metadata_of(entry)
    names = NAME_CHECKS.get(task)
    why = None if names is None else names(metadata, entry, task)
    if why is not None:
        return why
    grammar = grammar_for(task, entry)
    if task == "intermediate_integration" and isinstance(grammar, Expression):
        grammar = dataclasses.replace(grammar, functions=grammar.functions | {"Integral"})
    if grammar is not None:
        why = _in_grammar(entry.get("answer") if isinstance(entry, Mapping) else None, grammar)
        if why is not None:
            return f"the reference answer {why}"
    for check in METADATA_CHECKS.get(task, ()):
        why = check(metadata, entry, task)
        if why is not None:
            return why
    return None
