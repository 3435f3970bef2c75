"""Numbers in LaTeX answers read without Python's eval.

latex2sympy (math-verify's LaTeX reader) builds sympy objects from a parse tree, but reads each
numeral with `sympy.Number(text)`, which is `sympify`, which is `parse_expr`, which is `eval`
of the text. Its lexer lets only digits, `.`, `,`, `E`, `+`, `-` into a numeral, so no name or
call can get through today; we do not rely on that. `install()` replaces its two number
readers with `number()`, which takes only a numeral (checked here) and builds the same sympy
Integer or Float directly. Called in the worker before math-verify reads an answer;
`tests/verifiers/test_equivalence.py` checks with an audit hook that no answer text is compiled.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def number(text: str):  # -> sympy.Number
    """What `sympy.Number(text)` gives for a numeral (`12`, `1.5`, `.5`, `7E+9`), built without
    sympify; ValueError for anything else (latex2sympy then treats the answer as unreadable)."""
    import sympy

    if _INTEGER.fullmatch(text):
        return sympy.Integer(text)
    if _DECIMAL.fullmatch(text):
        return sympy.Float(text)
    raise ValueError(f"not a numeral: {text[:40]!r}")


def _parse_number(self, text: str):
    """latex2sympy's `_Latex2Sympy.parse_number`: thousands commas dropped, then the numeral."""
    return number(text.replace(",", ""))


def _convert_number(text: str):
    """latex2sympy's `convert_number` (an answer such as `333,333`; `0,5` is a decimal comma)."""
    if "," in text and text.startswith("0"):
        text = text.replace(",", ".")
    return number(text.translate(str.maketrans("", "", ", ")).lstrip("0") or "0")


def install() -> None:
    """Make latex2sympy read numerals with `number()`; loud if its readers moved (an upgrade)."""
    from latex2sympy2_extended import latex2sympy2

    if not (hasattr(latex2sympy2, "convert_number") and hasattr(latex2sympy2._Latex2Sympy, "parse_number")):
        raise RuntimeError("latex2sympy2_extended no longer has convert_number/parse_number: re-audit its numbers")
    latex2sympy2.convert_number = _convert_number
    latex2sympy2._Latex2Sympy.parse_number = _parse_number
