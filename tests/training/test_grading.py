"""Reward grading, a phase of its own: each rollout graded under the student's chat format with the
flag its prompt carries, the verdicts grading gave inside the teacher's rows before (the same rule:
a template that opened `<think>` leaves an unclosed completion without an answer)."""

from __future__ import annotations

from transformers import AutoTokenizer

from selfopd.config import load_config
from selfopd.data.example import Example
from selfopd.engines.base import Rollout
from selfopd.templating.chat_format import ChatFormat
from selfopd.training.grading import grade_groups, student_format
from selfopd.verifiers import Grading, grade
from tests.templating.test_chat_format import OPENING_TEMPLATE

SEVEN = Example(id="q", prompt="What is 3 + 4?", answer="7")


def test_each_rollout_is_graded_as_the_user_sees_it_with_its_prompts_flag(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = OPENING_TEMPLATE
    chat = student_format(load_config(None), tokenizer)
    prompt = chat.prompt([{"role": "user", "content": SEVEN.prompt}])
    assert prompt.opens_reasoning
    texts = [("3 + 4 = 7</think>\\boxed{7}", "stop"), ("\\boxed{7}", "stop"), ("</think>\\boxed{7}", "length"),
             ("</think>\\boxed{8}", "stop")]
    group = [Rollout(prompt.ids, tokenizer.encode(t, add_special_tokens=False), [0.0], finish, t) for t, finish in texts]
    told = grade_groups(chat, [SEVEN], [group], [prompt.opens_reasoning])
    decided = grade_groups(chat, [SEVEN], [group])  # no flag told: decided from each rollout's prompt ids
    before = [grade(r.text, SEVEN, finish_reason=r.finish_reason, grading=Grading(),  # the rule as it was
                    opened=Grading().opens_reasoning(tokenizer.decode(r.prompt_ids[-16:]))) for r in group]
    assert told[0].verdicts == decided[0].verdicts == before
    assert [v.correct for v in told[0].verdicts] == [True, False, False, False]
    assert told[0].against(0, group[0], Example(id="w", prompt=SEVEN.prompt, answer="8")).correct is False
    plain = ChatFormat(AutoTokenizer.from_pretrained(smollm2_dir))  # SmolLM2's template opens nothing
    assert [v.correct for v in grade_groups(plain, [SEVEN], [group], [False])[0].verdicts] == [True, True, False, False]
