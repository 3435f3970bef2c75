"""Brace matching for LaTeX snippets, shared by extraction and normalisation.

Written by hand (not a regex) because `\\boxed{\\frac{1}{\\sqrt{2}}}` nests, and an
unbalanced `\\boxed{` in a truncated generation must give "no match", never an error.
"""

from __future__ import annotations

import re


def matching_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` that closes the `{` at `open_index`, or None if unbalanced.

    Escaped braces (`\\{`, `\\}`, set notation in LaTeX) do not count toward the depth.
    """
    if open_index >= len(text) or text[open_index] != "{":
        return None
    depth = 0
    i = open_index
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def brace_pairs(text: str) -> dict[int, int]:
    """Index of each `{` that is closed -> index of its `}`, in one pass (escapes skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def command_arguments(text: str, names: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """Every `\\name{...}` with a balanced argument: (command start, `{` index, `}` index).

    A command whose argument is unbalanced is skipped; `\\textbf` is not taken for `\\text`.
    Linear time, so 5,000 unclosed `\\boxed{` in a runaway generation cost nothing.
    """
    pattern = re.compile(r"\\(?:" + "|".join(re.escape(n) for n in names) + r")(?![A-Za-z])\s*(?=\{)")
    starts = list(pattern.finditer(text))
    if not starts:
        return []
    pairs = brace_pairs(text)
    return [(m.start(), m.end(), pairs[m.end()]) for m in starts if m.end() in pairs]


def unwrap_commands(text: str, names: tuple[str, ...]) -> str:
    """Replace each `\\name{arg}` by `arg` (innermost first, so nesting works)."""
    for _ in range(100):  # bounded: each pass removes one command
        spans = command_arguments(text, names)
        if not spans:
            return text
        start, open_i, close = spans[-1]  # the last one is never the parent of an earlier one
        text = text[:start] + text[open_i + 1 : close] + text[close + 1 :]
    return text


def top_level_commas(text: str) -> int:
    """Number of commas outside any (), [], {} or \\{ \\} group."""
    depth = 0
    commas = 0
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            depth += 1 if text[i + 1] == "{" else -1
            i += 2
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            commas += 1
        i += 1
    return commas
