"""Sibling demonstrations (SDPO): which rollout's text a teacher sees, the fallback for the
others, and the saved records that let diagnostics re-render the teacher prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest

import selfopd.templating.chat_format as chat_format_module
from selfopd.config import ConfigError, load_config
from selfopd.templating.demonstrations import pick_demonstrations
from selfopd.diagnostics.context import Prompting
from selfopd.run.rollouts import read_records
from selfopd.data.example import Example
from selfopd.training.teachers import check_templates_render
from selfopd.templating.lint import lint_template
from selfopd.templating.templates import TemplateError, load_template, render_student, render_teacher
from selfopd.training.trainer import build_run, train_step

EXAMPLE = Example(id="toy/1", prompt="What is 3 + 4?", answer="7")
SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1", "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false",
    "run.eval_every=0", "model.threads=1", "teacher.template=teacher/sibling",
]


def test_a_demonstration_is_another_correct_rollout_chosen_by_seed_step_group_row():
    texts, correct = ["a", "b", "c", "d"], [True, False, True, True]
    chosen = pick_demonstrations(texts, correct, seed=0, step=3, group=5)
    for row, text in enumerate(chosen):
        assert text in {"a", "c", "d"} - {texts[row]}
    assert chosen == pick_demonstrations(texts, correct, seed=0, step=3, group=5)  # a resumed run picks the same
    picks = {tuple(pick_demonstrations(texts, correct, seed=seed, step=step, group=5))
             for seed in range(3) for step in range(3)}
    assert len(picks) > 1  # the choice does depend on the seed and step
    assert pick_demonstrations(["a", "b"], [True, False], seed=0, step=0, group=0) == [None, "a"]  # a lone success
    assert pick_demonstrations(["a", "b"], [True, False], seed=0, step=0, group=0, skip_self=False) == ["a", "a"]
    assert pick_demonstrations(["a", "b"], [False, False], seed=0, step=0, group=0) == [None, None]


def test_the_sibling_template_shows_the_demonstration_not_the_answer_and_falls_back_without_one():
    sibling, empty = load_template("teacher/sibling"), load_template("teacher/empty")
    student = render_student(load_template("student/plain"), EXAMPLE)
    shown = render_teacher(sibling, EXAMPLE, student, demonstration="3 + 4 = 7.", fallback=empty)
    assert "3 + 4 = 7." in shown[-1]["content"] and shown[-1]["content"].endswith(EXAMPLE.prompt)
    assert "answer" not in sibling.variables
    assert render_teacher(sibling, EXAMPLE, student, fallback=empty) == render_teacher(empty, EXAMPLE, student)
    with pytest.raises(TemplateError, match="demonstration"):  # no fallback given: the variable is missing
        render_teacher(sibling, EXAMPLE, student)
    assert lint_template(sibling, load_template("student/plain"), [EXAMPLE]) == []


def test_demonstration_in_a_student_template_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "peek.jinja"
    bad.write_text("{{ prompt }} {{ demonstration }}")
    with pytest.raises(TemplateError, match="student template .*peek.* uses 'demonstration'"):
        check_templates_render(load_template(bad), load_template("teacher/sibling"), EXAMPLE,
                               load_template("teacher/empty"))


def test_a_fallback_that_uses_demonstration_is_refused(tmp_path, tiny_model_dir):
    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
                                "teacher.demonstration_fallback=teacher/sibling"])
    with pytest.raises(ConfigError, match="teacher.demonstration_fallback: 'teacher/sibling' uses 'demonstration'"):
        build_run(config)


def test_saved_rollouts_record_the_demonstration_and_diagnostics_render_it(tmp_path, tiny_model_dir, monkeypatch):
    """A tiny random model is never right, so the verifier is replaced by one that passes the
    first sample of each group: that sample has no other success (fallback), the others show it."""
    real_grade = chat_format_module.grade
    calls = []

    def first_of_group_correct(text, example, **how):
        verdict = real_grade(text, example, **how)
        calls.append(text)
        first = len(calls) % 3 == 1
        return dataclasses.replace(verdict, correct=first, reward=float(first))

    monkeypatch.setattr(chat_format_module, "grade", first_of_group_correct)  # the step's grading
    run = build_run(load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
                                       "run.name=sibling"]))
    run.run_dir.mkdir(parents=True)
    metrics = train_step(run)
    assert metrics["teacher/demonstration_share"] == pytest.approx(4 / 6)
    records = read_records(run.folder.rollouts_file(1))
    for group in (0, 1):
        rows = [r for r in records if r.group == group]
        assert rows[0].demonstration is None
        assert [r.demonstration for r in rows[1:]] == [rows[0].text, rows[0].text]
    prompting = Prompting(run.tokenizer, run.student_template, run.teacher.template,
                          {e.id: e for e in run.train_examples}, run.teacher.demonstration_fallback)
    example = prompting.example(records[1].id)
    shown = prompting.teacher_messages(example, records[1].text, demonstration=records[1].demonstration)
    assert records[1].demonstration in shown[-1]["content"]
    fallback = prompting.teacher_ids(example, records[0].text)
    assert fallback == prompting.student_ids(example)  # teacher/empty: the student's own prompt
    old_line = {k: v for k, v in json.loads(run.folder.rollouts_file(1).read_text().splitlines()[0]).items()
                if k != "demonstration"}
    old_file = tmp_path / "old.jsonl"
    old_file.write_text(json.dumps(old_line) + "\n")
    assert read_records(old_file)[0].demonstration is None  # files saved before the field still read


def test_strip_reasoning_shows_a_sibling_without_its_reasoning_blocks(smollm2_tokenizer):
    """SDPO's remove_thinking_from_demonstration: the demonstration is what the user reads of the
    sibling, its <think> blocks (and, where the prompt opened one, the text up to its close) dropped."""
    from selfopd.engines.base import Rollout
    from selfopd.training.grading import Graded
    from selfopd.training.teacher import demonstration_texts
    from selfopd.templating.chat_format import ChatFormat

    texts = ["<think>try 3+4</think>\n\nThe answer is 7.", "scratch 3+4=7</think> It is 7.", "No blocks: 7."]
    rollouts = [Rollout([1], [2], [0.0], "stop", text) for text in texts]
    graded = Graded(ChatFormat(smollm2_tokenizer), [False, True, False], [])
    assert demonstration_texts(rollouts, graded, strip_reasoning=False) == texts
    assert demonstration_texts(rollouts, graded, strip_reasoning=True) == ["The answer is 7.", "It is 7.", "No blocks: 7."]
