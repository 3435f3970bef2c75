"""The one record every stage of selfopd passes around: a prompt and what a teacher may know."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """A task item. `prompt` is what the student sees; the rest is privileged information.

    answer:   the reference final answer, as text (verifiers compare against it).
    solution: an optional worked solution (privileged context for a teacher).
    hints:    optional hints, most general first (privileged context for a teacher).
    meta:     anything else from the source (task name, difficulty, source row, ...);
              reasoning-gym items keep their generator entry here for `score_answer`.
    """

    id: str
    prompt: str
    answer: str
    solution: str | None = None
    hints: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


def prompt_key(prompt: str) -> str:
    """A prompt's identity: the first 16 hex digits of the sha256 of its text, surrounding
    whitespace ignored. Two items with the same key are one prompt: greedy decoding answers
    them alike, so they count once. Short enough to list thousands in a run folder;
    collisions are vanishingly unlikely at the dataset sizes selfopd sees."""
    return hashlib.sha256(prompt.strip().encode()).hexdigest()[:16]
