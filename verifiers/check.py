"""Grade a whole completion: extract its final answer, compare, and phrase the feedback."""

from __future__ import annotations

from typing import Any

from .attribute import verify_attribute
from .equivalence import Verdict, compare_answers
from .extract import equation_result, extract_answer, extract_boxed, extract_gsm8k
from .reasoning_gym_adapter import verify_reasoning_gym
from .result import VerifyResult, graded, no_answer, unchecked
from .timeout import DEFAULT_TIMEOUT_S


def reference_answer(reference: str) -> str:
    """The final answer inside a reference that is a whole solution (`\\boxed{}` or `####`),
    read as a completion's is: a worked equation ("3 + 4 = 7") is its right-hand side, so a
    student who writes exactly the reference's answer is graded correct. A box that does not close
    is read as a completion's would be (its last answer-like part), for the same reason."""
    found = extract_boxed(reference) or extract_gsm8k(reference)
    if found is None and "\\boxed" in reference:
        extraction = extract_answer(reference)
        found = extraction.text if extraction is not None else None
    return equation_result(found or reference)


def verify(completion: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> VerifyResult:
    """Grade `completion` against the reference final answer (reward 1.0 if equivalent, else 0.0)."""
    found = extract_answer(completion)
    if found is None:
        return no_answer()
    verdict = compare_answers(found.text, reference_answer(reference), timeout_s=timeout_s)
    if verdict is Verdict.UNCHECKED:
        return unchecked(found.text, found.method)
    return graded(found.text, found.method, verdict is Verdict.EQUIVALENT)


def verify_example(completion: str, example: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   partial_credit: bool = False) -> VerifyResult:
    """Grade against an example with `.answer` and `.meta` (e.g. selfopd's Example).

    A reasoning-gym item carries `meta["reasoning_gym"] = {"task": name, "entry": {...}}` and
    is scored by reasoning-gym itself (its partial credit is the reward only with
    `partial_credit`); a question about a fact, `meta["fact"] = {"attribute": ..., "rivals": [...]}`,
    by `attribute.verify_attribute`; anything else is compared with `example.answer`.
    """
    meta = getattr(example, "meta", None) or {}
    rg = meta.get("reasoning_gym")
    if isinstance(rg, dict) and "task" in rg and "entry" in rg:
        return verify_reasoning_gym(completion, rg["task"], rg["entry"], timeout_s=timeout_s,
                                    partial_credit=partial_credit)
    fact = meta.get("fact")
    if isinstance(fact, dict) and "attribute" in fact and "rivals" in fact:
        return verify_attribute(completion, example.answer, fact["rivals"], fact["attribute"])
    return verify(completion, example.answer, timeout_s=timeout_s)
