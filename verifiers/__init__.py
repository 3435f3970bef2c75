"""Answer extraction and checking for math-style answers.

Used as the verifier reward in RL and as privileged feedback for a teacher. Every check
that might be slow runs in a killable worker process under a time limit (see `timeout.py`),
so it is safe in the main thread, in thread pools and in worker processes.

    verify(completion, reference)             -> VerifyResult
    verify_example(completion, example)       -> VerifyResult (reasoning-gym items go to its scorer)
    verify_reasoning_gym(completion, task, entry) -> VerifyResult
    grade(completion, example, finish_reason=, grading=) -> VerifyResult (what a user sees: the
                                                text after a reasoning block, a finished completion)
    extract_answer(text)                      -> Extraction | None
    answers_equivalent(predicted, reference)  -> bool

Model-written programs (imported from their modules, not here): `code_runner.run_tests(program, tests)`
runs one sandbox per test (`code_tests` reads the test rows); `code_feedback.grade_program(program,
tests, hidden=)` gives the reward, the pass counts, the hidden tests' pass rate and SDPO-style feedback.
"""

from .check import reference_answer, verify, verify_example
from .equivalence import Verdict, answers_equivalent, compare_answers
from .extract import METHODS, Extraction, extract_answer
from .final import Grading, final_text, grade
from .normalize import normalize_answer
from .reasoning_gym_adapter import verify_reasoning_gym
from .result import VerifyResult
from .timeout import DEFAULT_TIMEOUT_S, CheckTimeout, WorkerError, run_in_worker, shutdown_workers

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "METHODS",
    "CheckTimeout",
    "Extraction",
    "Grading",
    "Verdict",
    "VerifyResult",
    "WorkerError",
    "answers_equivalent",
    "compare_answers",
    "extract_answer",
    "final_text",
    "grade",
    "normalize_answer",
    "reference_answer",
    "run_in_worker",
    "shutdown_workers",
    "verify",
    "verify_example",
    "verify_reasoning_gym",
]
