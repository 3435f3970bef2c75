"""Grade what the user will see: the text after a completion's reasoning block, and only a
completion that finished.

A thinking model writes its scratch work inside a reasoning block (`<think>...</think>` by
default) and its answer after it; a number it wrote while thinking is not its answer. So:
  - with a closed block, only the text after the last end delimiter is graded;
  - a block that opens and never closes (or a completion that ends inside a block the prompt
    opened: `opened`) has no answer;
  - a completion with no delimiters at all is graded whole, as before (SmolLM2 has none);
  - a completion cut at max_tokens (finish_reason "length") is wrong by default, unread:
    whatever number it last wrote was not a final answer (`truncated = "grade"` grades it).

This is the one place a completion becomes the text a verifier reads: training rewards,
in-run eval and `selfopd eval` all call `grade`. It only slices strings in this process;
what it hands on is graded as before (the worker still gets answers as data, `frames.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .check import verify_example
from .result import VerifyResult
from .timeout import DEFAULT_TIMEOUT_S

Truncated = Literal["wrong", "grade"]
TRUNCATED_CHOICES: tuple[str, ...] = ("wrong", "grade")


@dataclass(frozen=True)
class Grading:
    """How a completion is read before grading. An empty pair of delimiters: no reasoning blocks. The
    delimiters' rules (set together, different) are checked once, where the settings are read
    (selfopd's `[verifier]`, `selfopd.config.verifier`)."""

    reasoning_start: str = "<think>"
    reasoning_end: str = "</think>"
    truncated: Truncated = "wrong"

    def __post_init__(self) -> None:
        if self.truncated not in TRUNCATED_CHOICES:
            raise ValueError(f"truncated must be one of {TRUNCATED_CHOICES}, got {self.truncated!r}")

    @classmethod
    def of(cls, settings: Any) -> Grading:
        """The grading a config section with these three fields asks for (selfopd's `[verifier]`)."""
        return cls(settings.reasoning_start, settings.reasoning_end, settings.truncated)

    def opens_reasoning(self, prompt_text: str) -> bool:
        """The prompt ends inside a reasoning block (a chat template that opens `<think>` for the model)."""
        start = self.reasoning_start.strip()
        return bool(start) and prompt_text.rstrip().endswith(start)


def final_text(completion: str, grading: Grading = Grading(), opened: bool = False) -> str | None:
    """The part of `completion` a user reads as its answer; None when it ends inside a reasoning
    block (an unclosed `<think>`, or `opened` by the prompt and never closed)."""
    start, end = grading.reasoning_start.strip(), grading.reasoning_end.strip()
    if not start:
        return completion
    closed = completion.rfind(end)
    if closed >= 0:
        after = completion[closed + len(end):]
        return None if start in after else after  # a block opened again after the last close never closed
    return None if opened or start in completion else completion


TRUNCATED_FEEDBACK = "The response was cut off before it finished, so it has no final answer."
UNCLOSED_FEEDBACK = "The response ended inside its reasoning, so it has no final answer."


def grade(completion: str, example: Any, *, finish_reason: str = "stop", grading: Grading = Grading(),
          opened: bool = False, partial_credit: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> VerifyResult:
    """`verify_example` of what the user sees of `completion` (see the module's rules).
    `finish_reason`: "length" when the engine stopped it at max_tokens, else "stop"."""
    code = (getattr(example, "meta", None) or {}).get("code")
    code = code if isinstance(code, dict) else None  # a code task: its program runs in the sandbox only
    hidden = 0.0 if code is not None and code.get("hidden") else None  # no answer fails the hidden tests too
    if finish_reason == "length" and grading.truncated == "wrong":
        return VerifyResult(0.0, False, None, None, TRUNCATED_FEEDBACK, hidden_reward=hidden)
    text = final_text(completion, grading, opened)
    if text is None:
        return VerifyResult(0.0, False, None, None, UNCLOSED_FEEDBACK, hidden_reward=hidden)
    if code is not None:
        from .code_feedback import verify_code

        return verify_code(text, code)
    return verify_example(text, example, timeout_s=timeout_s, partial_credit=partial_credit)
