"""Reward grading, its own phase of a step: each rollout of the step graded as the user sees it
(`selfopd.templating.chat_format.ChatFormat.grade`: the text after a reasoning block, finished
completions only), under the student's chat format, whether or not the run has a teacher. The
teacher's rows (`selfopd.training.teacher`) read these verdicts: the feedback and demonstrations
they show, the rewards the loss trains on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from selfopd.config import TrainConfig
from selfopd.data.example import Example
from selfopd.engines.base import Rollout
from selfopd.episodes.prompt_tools import tool_template_kwargs
from selfopd.episodes.verdicts import grade_rollout
from selfopd.templating.chat_format import ChatFormat
from selfopd.verifiers import VerifyResult


def student_format(config: TrainConfig, tokenizer: Any) -> ChatFormat:
    """The student's chat format: its tokenizer, `student_kwargs` and `[verifier]`."""
    return ChatFormat.of(tokenizer, student_kwargs(config), config.verifier)


def student_kwargs(config: TrainConfig) -> dict[str, Any]:
    """The student's chat-template arguments in training: model.chat_template_kwargs and, with
    rollout.environment = 'tools', the tools' definitions (`tools`). Each teacher's arguments merge
    over these (`TeacherConfig.template_kwargs`), so its prompt shows the same tools."""
    return {**config.model.chat_template_kwargs, **tool_template_kwargs(config.rollout)}


@dataclass(frozen=True)
class Graded:
    """One prompt group's rollouts graded: a verdict per rollout, in order."""

    chat: ChatFormat  # the student's: how a completion is read
    opened: list[bool]  # per rollout: its prompt opened a reasoning block (decided when it was tokenized)
    verdicts: list[VerifyResult]

    def against(self, index: int, rollout: Rollout, example: Example, partial_credit: bool = False) -> VerifyResult:
        """The group's rollout `index` graded against another example's reference (a wrong context's feedback)."""
        return self.chat.grade(rollout.text, example, rollout.finish_reason, self.opened[index], partial_credit)


def grade_groups(chat: ChatFormat, examples: Sequence[Example], groups: Sequence[Sequence[Rollout]],
                 opened: Sequence[bool] | None = None, partial_credit: bool = False) -> list[Graded]:
    """Each group's rollouts graded against its example. `opened`: per prompt, whether it opened a
    reasoning block (the request's, decided when it was tokenized); None: decided here from each
    rollout's prompt ids, by the same rule (`ChatFormat.opens_reasoning`)."""
    graded = []
    for index, (example, rollouts) in enumerate(zip(examples, groups)):
        opens = ([opened[index]] * len(rollouts) if opened is not None
                 else [chat.opens_reasoning(r.prompt_ids) for r in rollouts])
        verdicts = [grade_rollout(chat, r, example, o, partial_credit) for r, o in zip(rollouts, opens)]
        graded.append(Graded(chat, opens, verdicts))
    return graded

