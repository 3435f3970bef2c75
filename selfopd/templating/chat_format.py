"""One chat format per role, both ways: messages to the exact ids a model is prompted with, and a
completion back to what the user sees (in the spirit of tinker-cookbook's renderers).

A `ChatFormat` is built once per role (the student, each teacher, evaluation, SFT, drift) from the
role's tokenizer, its merged chat-template arguments (`model.chat_template_kwargs` for the student,
`TeacherConfig.template_kwargs` over them for a teacher, `EvalConfig.template_kwargs` for an eval)
and the run's grading rules (`[verifier]`: `ChatFormat.of` is where a config section becomes a
`Grading`). Nothing else in selfopd calls a chat template (tests/test_structure.py holds it).

- `prompt(messages)`: the prompt's ids (ending with the assistant header: appending a completion's
  exact ids gives a valid sequence) and whether the template opened a reasoning block there (a
  thinking template's `<think>`), decided once when the prompt is tokenized and carried with it:
  grading reads the flag, never the ids again.
- `read(text, finish_reason, opened)`: what the user sees of a completion (`verifiers.final_text`),
  and `grade` its verdict (`verifiers.grade`).
- `append(ids, messages)`: a conversation of several turns rendered turn by turn. `ids` ends after
  an assistant turn whose ids are the sampler's exact ids; the new messages (tool results, a user's
  reply, an environment's observation) are rendered after a fixed stand-in user turn and their text
  difference appended, after what closes the assistant turn past its stop token, so the history is never rendered again (the trick verl and verifiers use).
  Where a template renders every turn the same wherever it stands, `append` gives the ids of a
  one-shot render of the whole conversation; where it does not (Qwen3 drops the reasoning of the
  assistant turns before the last user message), the one-shot render is not what the model was
  prompted with, and `append`'s ids are (tests/templating/test_chat_format.py shows both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from selfopd.templating.chat_template import chat_ids, chat_text
from selfopd.templating.errors import TemplateError
from selfopd.verifiers import Grading, VerifyResult, final_text, grade

Message = Mapping[str, Any]
REASONING_TAIL = 16  # prompt tokens decoded to see whether the template opened a reasoning block
# The stand-in history `append` renders new messages after (a user turn), and the stand-in answer whose
# turn shows what closes an assistant turn.
_STAND_IN_USER = "selfopd stand-in question"
_STAND_IN_ANSWER = "selfopd stand-in answer"


@dataclass(frozen=True)
class PromptIds:
    """A prompt's exact ids, and whether its template opened a reasoning block (`<think>`) for the
    model: then a completion that never closes it has no answer (`verifiers.final_text`)."""

    ids: list[int]
    opens_reasoning: bool


@dataclass(frozen=True)
class Reading:
    """What the user sees of a completion: its final text (None: it ended inside its reasoning),
    how it ended, and whether it was cut at max_tokens."""

    final: str | None
    finish_reason: str
    truncated: bool


@dataclass(frozen=True, eq=False)
class ChatFormat:
    """One role's chat format: its tokenizer, chat-template arguments and grading rules."""

    tokenizer: Any
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    grading: Grading = Grading()

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_kwargs", MappingProxyType(dict(self.template_kwargs or {})))

    @classmethod
    def of(cls, tokenizer: Any, template_kwargs: Mapping[str, Any] | None, verifier: Any) -> ChatFormat:
        """The format of a role: `template_kwargs` are its merged chat-template arguments, `verifier` a
        section with the grading fields (selfopd's `[verifier]`, or `EvalConfig.grading`'s)."""
        return cls(tokenizer, template_kwargs or {}, Grading.of(verifier))

    # Messages to ids.

    def text(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template's text of `messages` (bounded: `selfopd.templating.chat_template`)."""
        return chat_text(self.tokenizer, messages, add_generation_prompt, self.template_kwargs)

    def ids(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The ids of `text(messages, add_generation_prompt)`, no special tokens added."""
        return chat_ids(self.tokenizer, messages, add_generation_prompt, self.template_kwargs)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of `messages` through the chat template, ending with the assistant header."""
        return self.ids(messages, True)

    def prompt(self, messages: Sequence[Message]) -> PromptIds:
        """`prompt_ids(messages)` and whether the template opened a reasoning block there."""
        ids = self.prompt_ids(messages)
        return PromptIds(ids, self.opens_reasoning(ids))

    def opens_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a prompt ends inside a reasoning block: its last 16 tokens decoded (a delimiter is a
        few tokens), so a long prompt is not decoded whole."""
        return self.grading.opens_reasoning(self.tokenizer.decode(list(prompt_ids[-REASONING_TAIL:])))

    # A completion back to what the user sees.

    def read(self, text: str, finish_reason: str = "stop", opened: bool = False) -> Reading:
        """What the user sees of the completion `text` after a prompt that `opened` a reasoning block or not."""
        return Reading(final_text(text, self.grading, opened), finish_reason, finish_reason == "length")

    def grade(self, text: str, example: Any, finish_reason: str = "stop", opened: bool = False,
              partial_credit: bool = False) -> VerifyResult:
        """The verdict on the completion `text` of `example` (`verifiers.grade` under this role's grading)."""
        return grade(text, example, finish_reason=finish_reason, grading=self.grading, opened=opened,
                     partial_credit=partial_credit)

    # Several turns, incrementally.

    def append(self, ids: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """`ids` (a conversation so far, ending after an assistant turn: the sampler's exact ids, its
        stop token last when it stopped on one) and then the ids of `messages` and the next
        generation prompt: the end of the assistant turn its stop token leaves out (SmolLM2's and
        Qwen's newline after `<|im_end|>`), then the new messages as the template renders them after
        a stand-in user turn. The history is never rendered again."""
        return [*ids, *self.continuation(ids, messages)]

    def continuation(self, ids: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """The ids `append` adds after `ids`."""
        if not messages:
            raise TemplateError("a turn appends at least one message")
        if any(m.get("role") == "assistant" for m in messages):
            raise TemplateError("an assistant turn is the sampler's exact ids, never rendered: append the messages "
                                "between assistant turns")
        user = {"role": "user", "content": _STAND_IN_USER}
        turn = self.text([user, {"role": "assistant", "content": _STAND_IN_ANSWER}], add_generation_prompt=False)
        closer = turn[turn.rindex(_STAND_IN_ANSWER) + len(_STAND_IN_ANSWER):]  # SmolLM2's '<|im_end|>\n'
        if ids and ids[-1] in set(self.tokenizer.all_special_ids):  # the sampler's stop token: part of the closer
            stop = self.tokenizer.decode([ids[-1]])
            closer = closer[len(stop):] if closer.startswith(stop) else closer
        before = self.text([user], add_generation_prompt=False)
        after = self.text([user, *messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the chat template renders a user message differently once more messages follow: "
                                "a conversation cannot be rendered turn by turn with it")
        return list(self.tokenizer(closer + after[len(before):], add_special_tokens=False)["input_ids"])
