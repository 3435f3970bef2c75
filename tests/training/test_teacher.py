"""selfopd.training.teacher: what the teacher is shown for each rollout (verdict, privileged
context, the student's exact completion, the wrong-context baseline) and what it scores, driven
directly with the packaged tokenizer, the shipped templates and a real (tiny) in-process engine."""

from __future__ import annotations

import pytest
import torch

from selfopd.config import DEFAULT_TEACHER, ConfigError, load_config
from selfopd.data.example import Example
from selfopd.engines.base import Rollout
from selfopd.engines.build import load_model
from selfopd.engines.local import LocalEngine
from selfopd.templating.templates import load_template, prompt_token_ids, render_student, render_teacher
from selfopd.training.teacher import TeacherSide, score_rows, teacher_rows

torch.set_num_threads(1)

EXAMPLES = [Example(id="toy/1", prompt="What is 3 + 4?", answer="7"),
            Example(id="toy/2", prompt="What is 10 - 8?", answer="2")]
TEXTS = [["3 + 4 = 7. The answer is 7.", "The answer is 9.", "The answer is 5."],
         ["10 - 8 = 2. The answer is 2.", "The answer is 2.", "The answer is 12."]]


def _side(model_dir, engine, template: str = "teacher/reference_answer", *overrides: str) -> TeacherSide:
    config = load_config(None, [f"model.student={model_dir}", f"teacher.template={template}", *overrides])
    _, tokenizer = load_model(model_dir)
    return TeacherSide(config, tokenizer, engine, load_template(template), None, per_micro=3, temperature=1.0,
                       name=DEFAULT_TEACHER, table=config.teacher,
                       chat_kwargs=config.teacher.template_kwargs(config.model.chat_template_kwargs))


def _groups(side: TeacherSide):
    student = load_template("student/plain")
    messages = [render_student(student, e) for e in EXAMPLES]
    groups = []
    for m, texts in zip(messages, TEXTS):
        prompt_ids = prompt_token_ids(side.tokenizer, m)
        groups.append([Rollout(prompt_ids, side.tokenizer.encode(t, add_special_tokens=False), [0.0] * 3, "stop", t)
                       for t in texts])
    return messages, groups


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir)
    return LocalEngine(model, tokenizer, batch_size=8)


def test_each_rollout_is_verified_and_shown_with_its_privileged_context(tiny_model_dir, engine):
    side = _side(tiny_model_dir, engine)
    messages, groups = _groups(side)
    rows = teacher_rows(side, 0, EXAMPLES, messages, groups, first_group=4)
    assert [r.group for r in rows] == [4, 4, 4, 5, 5, 5]
    assert [r.verdict.correct for r in rows] == [True, False, False, True, True, False]
    for row in rows:
        expected = prompt_token_ids(side.tokenizer, render_teacher(side.template, row.example,
                                                                   messages[row.group - 4], row.rollout.text,
                                                                   row.verdict.feedback, None, None))
        assert row.prompt_ids == expected
        shown = side.tokenizer.decode(row.prompt_ids)
        assert f"final answer {row.example.answer}" in shown and row.example.prompt in shown
        assert row.wrong_prompt_ids is None and row.demonstration is None


def test_a_wrong_context_shows_a_failed_siblings_answer(tiny_model_dir, engine):
    side = _side(tiny_model_dir, engine, "teacher/reference_answer", "loss.opd_baseline=wrong_context")
    messages, groups = _groups(side)
    rows = teacher_rows(side, 0, EXAMPLES, messages, groups, first_group=0)
    for row in rows:
        wrong = side.tokenizer.decode(row.wrong_prompt_ids)
        assert f"final answer {row.example.answer}" not in wrong and row.example.prompt in wrong
    # group 0: rows 0 and 1 see a failed sibling's answer (9 or 5); row 2 sees 9 (the only other failure)
    assert "final answer 9" in side.tokenizer.decode(rows[2].wrong_prompt_ids)


def test_scores_are_the_engines_on_the_exact_ids_and_the_empty_context_control_is_zero(tiny_model_dir, engine):
    side = _side(tiny_model_dir, engine, "teacher/empty", "loss.opd_baseline=same_engine")
    messages, groups = _groups(side)
    rows = teacher_rows(side, 0, EXAMPLES, messages, groups, first_group=0)
    scored, states = score_rows(side, rows, step=0)
    assert states == [] and [s.correct for s in scored] == [r.verdict.correct for r in rows]
    pairs = [(r.prompt_ids, r.rollout.completion_ids) for r in rows]
    direct = engine.score(pairs[:3]) + engine.score(pairs[3:])  # in the trainer's micro-batches: bit for bit
    for s, d, row in zip(scored, direct, rows):
        assert row.prompt_ids == row.rollout.prompt_ids  # teacher/empty: the student's own prompt
        assert torch.equal(s.teacher_logprobs, d.logprobs) and len(s.teacher_logprobs) == len(row.rollout.completion_ids)
        assert torch.equal(s.baseline_logprobs, s.teacher_logprobs)  # no privileged context, no signal


def test_a_prompt_past_the_teachers_context_stops_the_step_naming_the_row(tiny_model_dir, engine, monkeypatch):
    side = _side(tiny_model_dir, engine)
    messages, groups = _groups(side)
    rows = teacher_rows(side, 6, EXAMPLES, messages, groups, first_group=0)
    monkeypatch.setattr(LocalEngine, "max_scored_tokens", property(lambda self: 40))
    with pytest.raises(ConfigError, match=r"step 7, data row 'toy/1'.*exceeds the teacher's context of 40"):
        score_rows(side, rows, step=6)


def test_an_answer_its_task_refuses_scores_zero_and_is_counted(tiny_model_dir, engine):
    """A rollout whose answer its reasoning-gym task's grammar refuses (here code) scores 0 and
    carries `rejected` into the step (its metric `verify/rejected_share`)."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("countdown", size=1, seed=1)[0]
    example = Example(id="countdown/0", prompt=entry["question"], answer=entry["answer"],
                      meta={"reasoning_gym": {"task": "countdown", "config": {}, "entry": entry}})
    side = _side(tiny_model_dir, engine)
    message = render_student(load_template("student/plain"), example)
    texts = [f"<answer>{entry['answer']}</answer>", "<answer>__import__('os').getpid()</answer>", "<answer>1</answer>"]
    prompt_ids = prompt_token_ids(side.tokenizer, message)
    group = [Rollout(prompt_ids, side.tokenizer.encode(t, add_special_tokens=False), [0.0] * 3, "stop", t)
             for t in texts]
    scored, _ = score_rows(side, teacher_rows(side, 0, [example], [message], [group], first_group=0), step=0)
    assert [(s.reward, s.rejected) for s in scored] == [(1.0, False), (0.0, True), (0.0, False)]


def test_the_teacher_prompt_follows_the_students_arguments_unless_it_sets_its_own(smollm2_dir):
    """TeacherSide.prompt_ids: teacher.chat_template_kwargs merged over model.chat_template_kwargs
    (a thinking-style template written for the tests, `tests.thinking_template`)."""
    from tests.thinking_template import EMPTY_THINK, thinking_tokenizer

    tokenizer, template = thinking_tokenizer(smollm2_dir), load_template("teacher/reference_answer")
    messages = render_teacher(template, EXAMPLES[0], render_student(load_template("student/plain"), EXAMPLES[0]))

    def prompt(*overrides: str) -> str:
        config = load_config(None, ["model.chat_template_kwargs=enable_thinking=false", *overrides])
        side = TeacherSide(config, tokenizer, None, template, None, 1, 1.0, DEFAULT_TEACHER, config.teacher,
                           config.teacher.template_kwargs(config.model.chat_template_kwargs))
        return tokenizer.decode(side.prompt_ids(messages))

    assert prompt().endswith("assistant\n" + EMPTY_THINK)
    assert prompt("teacher.chat_template_kwargs=enable_thinking=true").endswith("assistant\n")


def test_rewards_grade_the_text_after_the_reasoning_block_of_a_finished_completion(tiny_model_dir, engine):
    """Training rewards read what a user sees (`verifier.*`): the text after `</think>`, nothing in an
    unclosed block or one the prompt opened, and a completion cut at rollout.max_tokens is wrong by
    default (`verifier.truncated = 'grade'` reads it), on a reasoning-gym task through its scorer."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    example = Example(id="rg/0", prompt=entry["question"], answer=entry["answer"],
                      meta={"reasoning_gym": {"task": "basic_arithmetic", "config": {}, "entry": entry}})
    right, wrong = entry["answer"], str(int(entry["answer"]) + 1)
    message = render_student(load_template("student/plain"), example)

    def scored(*overrides: str) -> list:
        side = _side(tiny_model_dir, engine, "teacher/verifier_feedback", *overrides)
        prompt = prompt_token_ids(side.tokenizer, message)
        opened = prompt + side.tokenizer.encode("<think>\n", add_special_tokens=False)
        rollouts = [(prompt, f"<think>the answer is {wrong}</think>The answer is {right}", "stop"),
                    (prompt, f"<think>the answer is {right}</think>The answer is {wrong}", "stop"),
                    (prompt, f"<think>the answer is {right}", "stop"),
                    (opened, f"the answer is {right}", "stop"),
                    (prompt, f"So the answer is {right}", "length")]
        group = [Rollout(p, side.tokenizer.encode(t, add_special_tokens=False), [0.0] * 3, finish, t)
                 for p, t, finish in rollouts]
        rows = teacher_rows(side, 0, [example], [message], [group], first_group=0)
        return [(s.reward, s.no_answer, side.tokenizer.decode(s.teacher_prompt)) for s in score_rows(side, rows, 0)[0]]

    default = scored()
    assert [(reward, no_answer) for reward, no_answer, _ in default] == [
        (1.0, False), (0.0, False), (0.0, True), (0.0, True), (0.0, True)]
    assert "cut off before it finished" in default[4][2]  # the feedback the teacher is shown
    assert [reward for reward, _, _ in scored("verifier.truncated=grade")] == [1.0, 0.0, 0.0, 0.0, 1.0]
