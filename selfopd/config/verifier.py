"""The `[verifier]` section of a training config: what of a completion is graded (the text after
its reasoning block, only when it finished), in training rewards, in-run eval and `selfopd eval`
alike (`selfopd.templating.chat_format.ChatFormat.of` makes a role's `Grading` of it, where its chat format is
built). The delimiters' rules are checked here, once. Part of `selfopd.config`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from selfopd.config.settings import Section, check_printable, fail, setting

TruncatedPolicy = Literal["wrong", "grade"]
Isolation = Literal["sandbox", "limits"]


@dataclass(frozen=True)
class VerifierConfig(Section):
    """Grading reads what the user will see (docs/data-and-verifiers.md, "What is graded")."""

    SECTION: ClassVar[str] = "verifier"
    reasoning_start: str = setting(
        "<think>", "Opens a reasoning block: a completion's scratch work, never graded. With a block, only the text "
        "after its end is graded; a block that never closes (or one the chat template opened) has no answer. Empty "
        "together with reasoning_end: no reasoning blocks, the whole completion is graded.")
    reasoning_end: str = setting("</think>", "Closes a reasoning block (the text after the last one is graded).")
    truncated: TruncatedPolicy = setting(
        "wrong", "A completion stopped at max_tokens (finish_reason 'length'): 'wrong' (scored 0, not read: the "
        "number it last wrote is not a final answer) or 'grade' (graded like a finished one).")
    isolation: Isolation = setting(
        "sandbox", "Where answers are scored: 'sandbox', worker processes in a bubblewrap sandbox (no network, none "
        "of your files, processes or environment, a process limit; refused at start where bubblewrap cannot run); "
        "'limits', plain worker processes with rlimits and an audit hook only (machines without user namespaces). "
        "docs/security.md", guarded="'limits' scores model text without a sandbox")

    def __post_init__(self) -> None:
        super().__post_init__()
        start, end = self.reasoning_start.strip(), self.reasoning_end.strip()
        for name in ("reasoning_start", "reasoning_end"):
            check_printable(self._key(name), getattr(self, name))
        if bool(start) != bool(end):
            empty = "reasoning_start" if not start else "reasoning_end"
            fail(self._key(empty), "is empty while the other delimiter is set: set both, or leave both empty to "
                 "turn reasoning blocks off")
        if start and start == end:
            fail(self._key("reasoning_end"), f"must differ from verifier.reasoning_start, got {end!r} for both")
