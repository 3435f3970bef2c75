"""The start-time context check measures the teacher's prompts as the teacher renders them: with the
answer, solution, hints and fact sheet of the rows with the most such text, not the longest questions."""

from __future__ import annotations

import re

import pytest
from transformers import AutoConfig, AutoTokenizer

from selfopd.config import ConfigError, load_config
from selfopd.data.example import Example
from selfopd.templating.context_limits import CONTEXT_CHECKED, check_context
from selfopd.templating.templates import load_template, prompt_token_ids, render_student, render_teacher

# More rows with longer questions than the check tokenizes, each with a short solution.
ROWS = [Example(id=f"rows/{i}", prompt=f"What is {i} + {i}? Think it through and answer with one number.",
                answer=str(2 * i), solution=f"{i} + {i} = {2 * i}.") for i in range(CONTEXT_CHECKED + 6)]
LONG_SOLUTION = Example(id="rows/long", prompt="What is 1 + 1?", answer="2", solution="Count one, then one more. " * 400)


def _check(model_dir, examples, template: str = "teacher/worked_solution") -> None:
    config = load_config(None, [f"model.student={model_dir}", f"teacher.template={template}", "rollout.max_tokens=48"])
    model_config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    check_context(config, model_config, model_config, tokenizer, load_template("student/plain"),
                  load_template(template), None, examples, examples[:4])


def test_a_short_question_with_a_long_solution_is_refused_at_start_naming_its_row(tiny_model_dir):
    tokenizer, template = AutoTokenizer.from_pretrained(tiny_model_dir), load_template("teacher/worked_solution")
    messages = render_teacher(template, LONG_SOLUTION, render_student(load_template("student/plain"), LONG_SOLUTION),
                              attempt="", feedback="")
    over = len(prompt_token_ids(tokenizer, messages)) + 48 - 2048  # the tiny model's 2048 positions
    assert over > 0
    with pytest.raises(ConfigError, match=re.escape(
            f"teacher.template: data row 'rows/long' of {load_config(None).data.spec}: the teacher's prompt "
            "(teacher/worked_solution, ") + rf"\d+ tokens\) and the scored completion can reach \d+ tokens with "
            r"rollout\.max_tokens = 48, past the teacher's context of 2048 \(the teacher's max_position_embeddings\) "
            rf"by {over} tokens"):
        _check(tiny_model_dir, [*ROWS[:40], LONG_SOLUTION, *ROWS[40:]])


def test_rows_that_fit_pass_and_the_student_check_still_reads_questions(tiny_model_dir):
    _check(tiny_model_dir, ROWS)
    _check(tiny_model_dir, [*ROWS, LONG_SOLUTION], template="teacher/reference_answer")  # it does not show solutions


def test_a_vision_language_hub_layout_is_limited_by_its_text_configs_positions(tiny_family_dirs):
    """Qwen3.5's hub checkpoints keep max_position_embeddings in their text config; read from the top level
    there was no limit at all, and an in-process run's start-time check failed on an empty min()."""
    from selfopd.templating.context_limits import context_limits

    hub = AutoConfig.from_pretrained(tiny_family_dirs["qwen3_5_conditional"])
    assert not hasattr(hub, "max_position_embeddings") or hub.max_position_embeddings is None
    (student, _), (teacher, _) = context_limits(load_config(None), hub, hub)
    assert student == teacher == hub.get_text_config().max_position_embeddings == 2048
