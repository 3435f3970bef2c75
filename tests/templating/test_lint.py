"""selfopd.templating.lint: flags leaky, broken and inapplicable templates; passes clean ones."""

from __future__ import annotations

import pytest

from selfopd.data.example import Example
from selfopd.templating.lint import answer_follows_question, lint_template, template_role
from selfopd.templating.templates import load_template

SAMPLE = [
    Example(id=f"toy/{i}", prompt=f"What is {i} + 3?", answer=str(i + 3), solution=f"{i} + 3 = {i + 3}", hints=("Add.",))
    for i in range(1, 5)
]
STUDENT = load_template("student/plain")


def test_leaky_template_warns_and_reference_template_does_not():
    leaky = lint_template(load_template("teacher/answer_hint_leaky"), STUDENT, SAMPLE)
    assert [f.level for f in leaky] == ["warning"]
    assert "copying it is the teacher's shortcut" in leaky[0].message
    assert lint_template(load_template("teacher/reference_answer"), STUDENT, SAMPLE) == []


@pytest.mark.parametrize("name", ["student/plain", "student/boxed", "teacher/empty", "teacher/worked_solution",
                                  "teacher/hints", "teacher/verifier_feedback"])
def test_shipped_templates_are_clean_on_full_data(name):
    assert lint_template(load_template(name), STUDENT, SAMPLE) == []


def test_template_needing_absent_field_is_an_error():
    bare = [Example(id="bare/0", prompt="What is 1 + 1?", answer="2")]
    findings = lint_template(load_template("teacher/worked_solution"), STUDENT, bare)
    assert len(findings) == 1 and findings[0].level == "error"
    assert "uses 'solution'" in findings[0].message and "bare/0" in findings[0].message


def test_student_template_using_privileged_variable_is_an_error(tmp_path):
    path = tmp_path / "student" / "peek.jinja"
    path.parent.mkdir()
    path.write_text("{{ prompt }} {{ answer }}")
    template = load_template(path)
    assert template_role(template) == "teacher"  # it uses privileged variables...
    findings = lint_template(template, template, SAMPLE)  # ...and used as the student it must fail
    assert findings and findings[0].level == "error"


def test_unknown_variable_is_reported_with_file_and_line(tmp_path):
    path = tmp_path / "typo.jinja"
    path.write_text("{{ student_prompt }}\n{{ answr }}\n")
    findings = lint_template(load_template(path), STUDENT, SAMPLE)
    assert findings and all(f.level == "error" for f in findings)
    assert f"{path}:2: variable 'answr' is undefined" in findings[0].message


@pytest.mark.parametrize(
    "teacher_text, leaky",
    [
        ("What is 4 + 3?\n\nThe answer is 7.", True),
        ("Reference: the answer is 7.\n\nWhat is 4 + 3?", False),
        ("What is 4 + 3?\n\nCheck 17 and 70 and 0.7.", False),  # 7 only inside other numbers
        ("What is 4 + 3?", False),
    ],
)
def test_answer_follows_question(teacher_text, leaky):
    assert answer_follows_question(teacher_text, "What is 4 + 3?", "7") is leaky


def test_a_teacher_whose_arguments_move_the_scoring_point_is_warned_once(smollm2_dir, smollm2_tokenizer):
    """Measured by rendering: an argument that changes what the generation prompt adds warns (one
    line naming the setting); one the template ignores, or the same on both sides, does not."""
    from selfopd.templating.lint import boundary_findings, generation_prompt
    from tests.thinking_template import EMPTY_THINK, thinking_tokenizer

    thinking = thinking_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "hi"}]
    assert generation_prompt(thinking, messages, {"enable_thinking": False}) == "<|im_start|>assistant\n" + EMPTY_THINK
    (finding,) = boundary_findings(thinking, {"enable_thinking": False}, {"enable_thinking": True}, "teachers.big")
    assert finding.level == "warning" and finding.template == "teachers.big.chat_template_kwargs"
    assert "<think>" in finding.message and "\n" not in str(finding)
    assert boundary_findings(thinking, {}, {"enable_thinking": True}) == []  # the template's default anyway
    assert boundary_findings(smollm2_tokenizer, {}, {"enable_thinking": False}) == []  # ignored by SmolLM2's
    assert boundary_findings(thinking, {"enable_thinking": False}, {"enable_thinking": False}) == []
