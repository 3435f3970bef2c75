"""Are two final answers the same? Cheap exact rules first, math-verify for the rest.

Order of the checks, and why:
  1. normalise both (`normalize.py`); identical text is equal.
  2. plain words ("olleh", "Yes", "B") compare as text, case-insensitively: math-verify
     reads a word as a product of one-letter symbols, so it calls anagrams equal.
  3. plain numbers (3, -2.5, 1e3, 3/4, \\frac{3}{4}, 50%) compare exactly as fractions in
     this process: most RL answers stop here, with no sympy and no worker.
  4. shapes: a tuple/interval never equals a set `\\{..\\}` (math-verify says
     `(1,2)` = `\\{1,2\\}` when the reference is the set); a bare list `1, 2` facing an
     ordered pair `(a, b)` gets its parentheses, so its order counts (math-verify would
     read it as a set). Against `[a, b)` it stays a set: open or closed is not implied.
  5. refuse answers too big to compute (`prescreen.py`).
  6. math-verify (`parse` + `verify`) in a killable worker process (`timeout.py`). Without the
     math-verify package these answers count as unchecked, said once per process
     (`math_verify_installed`), not in a traceback per answer.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import re

from .latex import top_level_commas
from .normalize import normalize_answer
from .numeric import parse_plain_number
from .prescreen import too_costly
from .timeout import DEFAULT_TIMEOUT_S, CheckTimeout, WorkerError, run_in_worker

logger = logging.getLogger(__name__)

_PLAIN_TEXT = re.compile(r"[A-Za-z][A-Za-z' \-]*")
_MATH_NAMES = {"pi", "e", "i", "inf", "infinity", "oo"}  # words that are numbers


class Verdict(enum.Enum):
    """Outcome of a comparison. UNCHECKED (time limit, too costly, worker failure) is not equal."""

    EQUIVALENT = "equivalent"
    DIFFERENT = "different"
    UNCHECKED = "unchecked"


def _is_plain_text(s: str) -> bool:
    return bool(_PLAIN_TEXT.fullmatch(s)) and s.lower() not in _MATH_NAMES


def _shape(s: str) -> str:
    """"set" for \\{a, b\\}, "tuple" for (a, b) or [a, b), "list" for a, b, else "scalar"."""
    if s.startswith("\\{") and s.endswith("\\}") and top_level_commas(s[2:-2]):
        return "set"
    if s[:1] in "([" and s[-1:] in ")]" and top_level_commas(s[1:-1]) and not top_level_commas(s):
        return "tuple"
    if top_level_commas(s):
        return "list"
    return "scalar"


def _compare_numbers(pred: str, ref: str) -> Verdict | None:
    """Exact comparison when both are plain numbers; None to leave it to math-verify."""
    p, r = parse_plain_number(pred), parse_plain_number(ref)
    if p is None or r is None:
        return None
    if p.values & r.values:
        return Verdict.EQUIVALENT
    if p.is_fraction or r.is_fraction:
        return None  # 1/3 vs 0.333333: math-verify's rounding rule decides
    return Verdict.DIFFERENT


def compare_answers(predicted: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Compare a predicted final answer with the reference one (see the module docstring)."""
    pred, ref = normalize_answer(predicted), normalize_answer(reference)
    if not pred or not ref:
        return Verdict.DIFFERENT
    if pred == ref:
        return Verdict.EQUIVALENT
    if _is_plain_text(pred) or _is_plain_text(ref):
        same = " ".join(pred.lower().split()) == " ".join(ref.lower().split())
        return Verdict.EQUIVALENT if same else Verdict.DIFFERENT
    numbers = _compare_numbers(pred, ref)
    if numbers is not None:
        return numbers
    shapes = {_shape(pred), _shape(ref)}
    if shapes == {"set", "tuple"}:
        return Verdict.DIFFERENT
    ordered = pred if _shape(pred) == "tuple" else ref
    if shapes == {"list", "tuple"} and ordered.startswith("(") and ordered.endswith(")"):
        if _shape(pred) == "list":
            pred = f"({pred})"
        else:
            ref = f"({ref})"
    if too_costly(pred) or too_costly(ref) or not math_verify_installed():
        return Verdict.UNCHECKED
    try:
        same = run_in_worker("math_verify", pred, ref, timeout_s=timeout_s)
    except CheckTimeout:
        logger.warning("answer check timed out after %.1f s", timeout_s)
        return Verdict.UNCHECKED
    except WorkerError as e:
        logger.warning("answer check failed: %s", e)
        return Verdict.UNCHECKED
    return Verdict.EQUIVALENT if same else Verdict.DIFFERENT


@functools.cache
def math_verify_installed() -> bool:
    """Whether the math-verify package is importable here (the worker runs our interpreter, on our
    path); when not, one warning per process says what goes unchecked, instead of a worker that
    dies at start for every answer."""
    if importlib.util.find_spec("math_verify") is not None:
        return True
    logger.warning("math_verify is not installed: answers that are not plain numbers, words or the same text count "
                   "as unchecked (reward 0); pip install 'math-verify>=0.7' to check them")
    return False


def answers_equivalent(predicted: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when the predicted answer equals the reference; False when not, or not checkable in time."""
    return compare_answers(predicted, reference, timeout_s=timeout_s) is Verdict.EQUIVALENT


def math_verify_equivalent(predicted: str, reference: str) -> bool:
    """math-verify's verdict on two normalised answers. Runs inside the worker process.

    LaTeX extraction only: math-verify's default also tries its plain-expression reader, which
    hands the text to sympy's `parse_expr` (Python's eval). Its LaTeX reader builds sympy
    objects from a parse tree, and reads numerals without eval once `latex_numbers.install()`
    ran (`test_equivalence.py` checks with an audit hook that no answer text is compiled).
    Its own signal timeouts are off (None): the parent enforces the time limit by killing us.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    from .latex_numbers import install

    install()

    def read(s: str) -> list:
        latex = "$" + s.replace("%", "\\%") + "$"
        return parse(latex, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)

    gold, pred = read(reference), read(predicted)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
