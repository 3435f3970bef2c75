"""Score a completion with a reasoning-gym task's own `score_answer`.

reasoning-gym knows best what counts as right for its tasks (string tasks, number formats),
so we only extract the answer and let it score. Its scorers also give partial credit
("17" or "-7" score 0.5 against 7): that is the reward only when asked for, since a
GRPO reward built on it pays wrong answers. The scorer runs in the worker process under
the time limit: some scorers call sympy on the model's answer and could hang on `9**9**9**9`.

Some scorers read the answer with sympy's `parse_expr` or Python's `eval`, which run Python:
for those tasks the answer must first read in the task's grammar (`task_grammars.py`), or it
scores 0 as `rejected` without any scorer seeing it. They run the item's own reference or metadata
too, which a generator may have copied from a data spec's options: an item whose such field does not
read in its grammar (`references.py`) is not checked at all (0, `unchecked`: no verdict, and the
data's fault, not the answer's; logged as a warning). Some scorers pay for answers that break their
puzzle's rules: those answers score 0 before the scorer sees them (`strict_tasks.py`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from .extract import extract_answer
from .latex import command_arguments
from .normalize import strip_math_delimiters
from .prescreen import too_costly
from .references import screen_entry
from .result import VerifyResult, no_answer, rejected, scored, unchecked
from .strict_tasks import strict_reason
from .task_grammars import screen_answer
from .timeout import DEFAULT_TIMEOUT_S, CheckTimeout, WorkerError, run_in_worker

logger = logging.getLogger(__name__)


def answer_for_scorer(extracted: str) -> str:
    """The extracted text minus LaTeX wrapping a scorer would not expect (`$..$`, `\\text{..}`)."""
    s = strip_math_delimiters(extracted).strip()
    wrapped = command_arguments(s, ("text", "textbf", "mathrm"))
    if len(wrapped) == 1 and wrapped[0][0] == 0 and wrapped[0][2] == len(s) - 1:
        s = s[wrapped[0][1] + 1 : -1].strip()
    return s


@functools.lru_cache(maxsize=None)
def check_task(task: str) -> None:
    """Refuse an unknown task name loudly; in the worker it would only show as an unchecked 0."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task!r}")


@functools.lru_cache(maxsize=None)
def _score_fn(task: str) -> Callable[[str, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def import_reasoning_gym() -> None:
    """Import reasoning_gym (a few seconds the first time). Runs inside the worker process."""
    import reasoning_gym  # noqa: F401


def score_in_worker(task: str, answer: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's score for `answer` on `entry`, in [0, 1]. Runs inside the worker process."""
    score = float(_score_fn(task)(answer, entry) or 0.0)
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0


def verify_reasoning_gym(
    completion: str, task: str, entry: dict[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S,
    partial_credit: bool = False,
) -> VerifyResult:
    """Extract the final answer and score it with reasoning-gym task `task` on its `entry`.

    correct is score == 1; reward is 1.0 or 0.0, or reasoning-gym's own score (partial
    credit) with `partial_credit` (none for an answer that breaks its puzzle's rules: 0).
    """
    check_task(task)
    found = extract_answer(completion)
    if found is None:
        return no_answer()
    bad_item = screen_entry(task, entry)
    if bad_item is not None:  # before the answer: whatever it is, this item's scorer would run the item
        logger.warning("reasoning-gym %s: item not checked (%s): an item's reference and metadata must read in its "
                       "task's grammar", task, bad_item)
        return unchecked(found.text, found.method)
    answer = answer_for_scorer(found.text)
    refused = screen_answer(task, answer, entry)
    if refused is not None:
        logger.debug("reasoning-gym %s: answer rejected by the task's grammar: %s", task, refused)
        return rejected(found.text, found.method)
    if too_costly(answer):
        return unchecked(found.text, found.method)
    broken = strict_reason(task, answer, entry)
    if broken is not None:
        logger.debug("reasoning-gym %s: the answer breaks the puzzle's rules: %s", task, broken)
        return scored(found.text, found.method, 0.0, partial_credit)
    try:
        score = run_in_worker(
            "reasoning_gym_score",
            task,
            answer,
            entry,
            timeout_s=timeout_s,
            setup="import_reasoning_gym",  # seconds, once per worker: not part of the limit
        )
    except CheckTimeout:
        logger.warning("reasoning-gym %s scorer timed out after %.1f s", task, timeout_s)
        return unchecked(found.text, found.method)
    except WorkerError as e:
        logger.warning("reasoning-gym %s scorer failed: %s", task, e)
        return unchecked(found.text, found.method)
    return scored(found.text, found.method, score, partial_credit)
