"""Sibling demonstrations (SDPO): a teacher template that uses `demonstration` sees, for
each rollout, the text of another sample of the same prompt from the same step that the
verifier found correct. The choice among several is seeded by (run seed, step, group, row)
alone, so a resumed run, or one on more processes, picks the same demonstration."""

from __future__ import annotations

import random
from typing import Sequence


def pick_demonstrations(texts: Sequence[str], correct: Sequence[bool], *, seed: int, step: int, group: int,
                        skip_self: bool = True) -> list[str | None]:
    """For each rollout of one prompt group (`texts`, their verdicts `correct`), the text of
    a correct rollout of the group, or None when there is none to show. `skip_self`: a
    rollout is never its own demonstration (a lone success then gets None)."""
    if len(texts) != len(correct):
        raise ValueError(f"group {group}: {len(texts)} rollouts but {len(correct)} verdicts")
    chosen: list[str | None] = []
    for row in range(len(texts)):
        candidates = [index for index, ok in enumerate(correct) if ok and not (skip_self and index == row)]
        if candidates:
            chosen.append(texts[random.Random(f"{seed}/{step}/{group}/{row}").choice(candidates)])
        else:
            chosen.append(None)
    return chosen
