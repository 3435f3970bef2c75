"""The verdict record, and the one-sentence feedback a teacher may see as privileged context.

Feedback quotes only the student's own extracted answer, never the reference, so it can be
put in a teacher prompt without handing the teacher the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_QUOTED_CHARS = 80  # feedback stays one short sentence even for a runaway answer


@dataclass(frozen=True)
class VerifyResult:
    """What a verifier concluded about one completion.

    reward:    1.0 correct, 0.0 otherwise (wrong, no answer, or not checkable in time);
               a reasoning-gym task's own score in [0, 1] only when partial credit was
               asked for (its scorers pay 0.5 for "17" or "-7" when the answer is 7).
    correct:   reward == 1.0.
    extracted: the final answer text as found in the completion, None if none was found.
    method:    the extraction rule that found it (see `extract.METHODS`), None if none;
               'environment' where an environment's reward graded it (its `extracted`: the reply).
    feedback:  one short sentence about the student's answer, without the reference.
    unchecked: no verdict was reached (time limit hit, answer too costly to evaluate, or the
               checker failed); it counts as wrong, and is worth counting in run metrics.
    rejected:  the answer was not in its task's safe grammar (`task_grammars.py`), so the
               task's scorer, which would run it as Python, never saw it; it counts as wrong
               (metric `verify/rejected_share`).
    """

    reward: float
    correct: bool
    extracted: str | None
    method: str | None
    feedback: str
    unchecked: bool = False
    rejected: bool = False
    # A code task's hidden tests (never in any feedback): their pass fraction beside `reward`, the shown
    # tests'; None for every other task.
    hidden_reward: float | None = None


def quote(answer: str) -> str:
    """The answer on one line, shortened for a feedback sentence."""
    one_line = " ".join(answer.split())
    if len(one_line) > MAX_QUOTED_CHARS:
        one_line = one_line[: MAX_QUOTED_CHARS - 3] + "..."
    return one_line


def no_answer() -> VerifyResult:
    return VerifyResult(0.0, False, None, None, "No final answer was found in the response.")


def graded(extracted: str, method: str, correct: bool) -> VerifyResult:
    verdict = "correct" if correct else "wrong"
    return VerifyResult(
        float(correct), correct, extracted, method, f"Your final answer {quote(extracted)} is {verdict}."
    )


def unchecked(extracted: str, method: str) -> VerifyResult:
    feedback = f"Your final answer {quote(extracted)} could not be checked, so it counts as wrong."
    return VerifyResult(0.0, False, extracted, method, feedback, unchecked=True)


def rejected(extracted: str, method: str) -> VerifyResult:
    feedback = (f"Your final answer {quote(extracted)} is not written in a form this task accepts, "
                "so it counts as wrong.")
    return VerifyResult(0.0, False, extracted, method, feedback, rejected=True)


def scored(extracted: str, method: str, score: float, partial_credit: bool = False) -> VerifyResult:
    """A result from a task's own scorer. Its partial credit becomes the reward only when
    `partial_credit`; otherwise anything short of a full score is wrong (reward 0)."""
    if score >= 1.0 or score <= 0.0 or not partial_credit:
        return graded(extracted, method, score >= 1.0)
    feedback = f"Your final answer {quote(extracted)} is only partly correct (score {score:.2f})."
    return VerifyResult(score, False, extracted, method, feedback)
