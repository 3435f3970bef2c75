"""A deliberately wrong privileged context for the same question: what a teacher's score under
the true context shares with its score under a wrong one is what the context merely leaks or
restyles, not evidence about the answer. Used by the diagnostics (the wrong-context contrast)
and by the contrastive teacher signal (`loss.opd_baseline = "wrong_context"`)."""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Sequence

from selfopd.data.example import Example
from selfopd.verifiers import reference_answer

_NUMBER = re.compile(r"^-?\d+$")


def wrong_example(example: Example, other: Example, seed: int = 0, answer: str | None = None) -> Example:
    """The same question with a wrong privileged context: `answer` when given (a failed
    sibling's final answer), else a nearby wrong number (or `other`'s answer); `other`'s
    solution and hints. Reasoning-gym's own scorer is dropped, so feedback is computed
    against the wrong answer."""
    right = reference_answer(example.answer).strip()
    if answer is not None and answer.strip() and answer.strip() != right:
        wrong = answer.strip()
    elif _NUMBER.match(right):
        offset = random.Random(f"{seed}/{example.id}").choice([-3, -2, -1, 1, 2, 3])
        value = int(right) + offset
        wrong = str(value if value >= 0 or int(right) < 0 else int(right) + abs(offset))
    else:
        wrong = reference_answer(other.answer).strip()
        if wrong == right:
            wrong = f"not {right}"
    meta = {key: value for key, value in example.meta.items() if key != "reasoning_gym"}
    return dataclasses.replace(example, answer=wrong, solution=other.solution if example.solution else None,
                               hints=other.hints if example.hints else (), meta=meta)


def failed_sibling_answers(extracted: Sequence[str | None], correct: Sequence[bool], *, seed: int, step: int,
                           group: int) -> list[str | None]:
    """For each rollout of one prompt group, the final answer of another rollout of the group
    that the verifier found wrong (seeded choice; never the rollout itself), or None when no
    other failed rollout stated an answer: the wrong context then falls back to a perturbed
    reference answer."""
    chosen: list[str | None] = []
    for row in range(len(extracted)):
        candidates = [extracted[i] for i, ok in enumerate(correct) if not ok and i != row and extracted[i]]
        chosen.append(random.Random(f"{seed}/{step}/{group}/{row}/wrong").choice(candidates) if candidates else None)
    return chosen
