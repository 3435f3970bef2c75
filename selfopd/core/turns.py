"""Where an episode's turns lie in its completion, read off its loss mask: the one place that
heatmaps and the diagnostics report cut a saved episode into the student's turns and the
environment's messages between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ENVIRONMENT_LABEL = "environment"


@dataclass(frozen=True)
class Segment:
    """Completion ids [start, end) of one role: a student turn, or the environment's ids after it."""

    start: int
    end: int
    student: bool
    turn: int  # the student turn (1 for the first); an environment segment has the turn it answers

    @property
    def label(self) -> str:
        """"turn k" for the student's k-th turn, "environment" for the ids the environment added."""
        return f"turn {self.turn}" if self.student else ENVIRONMENT_LABEL


def segments(students: Sequence[bool]) -> list[Segment]:
    """The runs of equal values of `students` (True: an id the student wrote), in order, each
    student run numbered as the next turn."""
    found: list[Segment] = []
    turn = 0
    for index, own in enumerate(students):
        own = bool(own)
        if found and found[-1].student == own:
            continue
        if found:
            found[-1] = Segment(found[-1].start, index, found[-1].student, found[-1].turn)
        turn += own
        found.append(Segment(index, len(students), own, turn))
    return found


def is_episode(students: Sequence[bool] | None) -> bool:
    """True when a mask marks some environment ids: a rollout of several turns. A mask of the
    student's ids only (an episode that ended after one answer) reads as a single answer."""
    return students is not None and not all(students)
