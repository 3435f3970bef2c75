"""Privileged-illusion diagnostics: where a teacher's advantage comes from, token by token.

A privileged teacher can look good because it sees what the student never will. These
tools split its per-token advantage by what the tokens are (copied answer, format,
epistemic words, other), contrast a correct with a deliberately wrong context, find
outputs that refer to context the student never saw, follow epistemic words and length
over training, and measure the accuracy gap a context opens before training.

    records   RolloutRecord, read_run_rollouts      the rollouts a run saves per step
    tokens    token_pieces, classify_tokens, ...    token classes from text spans
    measures  decompose, illusion_score, ...         numbers with bootstrap intervals
    context   privileged_gains, context_gap, ...     the parts that need a model
    report    measure_run, write_report              `selfopd diagnose RUN_DIR`
    teachers  one_teachers_part, run_teachers        one teacher of a run with several
"""

from selfopd.diagnostics.context import (Prompting, annotate_records, context_gap, fresh_records, privileged_gains,
                                         run_prompting, wrong_example)
from selfopd.diagnostics.measures import (
    ILLUSION_LIFT,
    Annotated,
    context_contrast,
    decompose,
    illusion_score,
    step_behaviour,
)
from selfopd.run.rollouts import RolloutRecord, read_records, read_run_rollouts
from selfopd.diagnostics.tokens import CLASSES, classify_tokens, leaked_phrases, token_pieces

__all__ = [
    "CLASSES",
    "ILLUSION_LIFT",
    "Annotated",
    "Prompting",
    "RolloutRecord",
    "annotate_records",
    "classify_tokens",
    "context_contrast",
    "context_gap",
    "decompose",
    "fresh_records",
    "illusion_score",
    "leaked_phrases",
    "privileged_gains",
    "run_prompting",
    "read_records",
    "read_run_rollouts",
    "step_behaviour",
    "token_pieces",
    "wrong_example",
]
