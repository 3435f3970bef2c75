"""selfopd.templating.templates: rendering, sandboxing, clear errors, and token sequences that fit together."""

from __future__ import annotations

import pytest

from selfopd.data.example import Example
from selfopd.templating.templates import (
    TemplateError,
    list_templates,
    load_template,
    prompt_token_ids,
    render_student,
    render_teacher,
)

FULL = Example(
    id="toy/1",
    prompt="What is 3 + 4?",
    answer="7",
    solution="Start at 3 and count up four: 4, 5, 6, 7.",
    hints=("Count up from the larger number.", "Four steps."),
    meta={"fact_sheet": "Fact sheet: arithmetic\n- 3 + 4: 7"},  # a document, as the kb: tasks give
)
BARE = Example(id="toy/2", prompt="What is 2 + 2?", answer="4")


def test_every_shipped_template_renders_on_a_full_example():
    student = render_student(load_template("student/plain"), FULL)
    names = list_templates()
    assert {"student/plain", "teacher/empty", "teacher/reference_answer", "teacher/worked_solution",
            "teacher/hints", "teacher/verifier_feedback"} <= set(names)
    for name in names:
        template = load_template(name)
        if name.startswith("student/"):
            messages = render_student(template, FULL)
        else:
            messages = render_teacher(template, FULL, student, attempt="It is 8.", feedback="Your final answer 8 is wrong.",
                                      demonstration="3 + 4 = 7.")
        assert messages[-1]["role"] == "user"
        assert FULL.prompt in messages[-1]["content"], name


def test_teacher_templates_carry_their_privileged_information():
    student = render_student(load_template("student/plain"), FULL)
    content = {
        name: render_teacher(load_template(name), FULL, student, "It is 8.", "Your final answer 8 is wrong.")[-1]["content"]
        for name in ("teacher/reference_answer", "teacher/worked_solution", "teacher/hints", "teacher/verifier_feedback")
    }
    assert "final answer 7" in content["teacher/reference_answer"]
    assert FULL.solution in content["teacher/worked_solution"]
    assert all(hint in content["teacher/hints"] for hint in FULL.hints)
    assert "It is 8." in content["teacher/verifier_feedback"]
    assert "Your final answer 8 is wrong." in content["teacher/verifier_feedback"]


def test_empty_context_control_gives_identical_token_ids(smollm2_tokenizer):
    student = render_student(load_template("student/boxed"), FULL)
    teacher = render_teacher(load_template("teacher/empty"), FULL, student)
    assert teacher == student
    assert prompt_token_ids(smollm2_tokenizer, teacher) == prompt_token_ids(smollm2_tokenizer, student)


def test_teacher_prompt_plus_student_completion_is_a_valid_sequence(smollm2_tokenizer):
    """The exact completion ids appended to the teacher prompt give the same ids as the
    chat template renders for the whole conversation: no retokenisation seam."""
    tokenizer = smollm2_tokenizer
    student = render_student(load_template("student/plain"), FULL)
    teacher = render_teacher(load_template("teacher/reference_answer"), FULL, student)
    completion = "3 + 4 = 7. The answer is \\boxed{7}."
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    prompt_ids = prompt_token_ids(tokenizer, teacher)
    whole = tokenizer.apply_chat_template(
        teacher + [{"role": "assistant", "content": completion}], tokenize=True, return_dict=False
    )
    assert list(whole[: len(prompt_ids) + len(completion_ids)]) == prompt_ids + completion_ids
    assert whole[len(prompt_ids) + len(completion_ids)] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert prompt_ids != prompt_token_ids(tokenizer, student)


def test_missing_variable_names_file_line_and_variable(tmp_path):
    path = tmp_path / "needs_solution.jinja"
    path.write_text("{{ student_prompt }}\n\nWorked solution:\n{{ solution }}\n")
    student = render_student(load_template("student/plain"), BARE)
    with pytest.raises(TemplateError) as error:
        render_teacher(load_template(path), BARE, student)
    message = str(error.value)
    assert f"{path}:4:" in message
    assert "'solution' is undefined" in message


def test_missing_variable_in_an_included_template_names_that_file(tmp_path):
    (tmp_path / "part.jinja").write_text("line one\n{{ hints | join(', ') }}\n")
    (tmp_path / "main.jinja").write_text("{{ student_prompt }}\n{% include 'part.jinja' %}\n")
    student = render_student(load_template("student/plain"), BARE)
    with pytest.raises(TemplateError, match=r"part\.jinja:2: variable 'hints' is undefined"):
        render_teacher(load_template(tmp_path / "main.jinja"), BARE, student)


def test_student_template_cannot_see_the_answer(tmp_path):
    path = tmp_path / "cheat.jinja"
    path.write_text("{{ prompt }} (answer: {{ answer }})")
    with pytest.raises(TemplateError, match="'answer' is undefined"):
        render_student(load_template(path), FULL)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ meta.update({'x': 1}) }}",
        "{{ hints.append('x') }}",
    ],
)
def test_sandbox_refuses_code_execution_and_mutation(tmp_path, source):
    path = tmp_path / "evil.jinja"
    path.write_text(source)
    student = render_student(load_template("student/plain"), FULL)
    with pytest.raises(TemplateError, match="evil.jinja:1: unsafe operation refused"):
        render_teacher(load_template(path), FULL, student)


def test_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("ok\n{% if answer %}\nno endif\n")
    with pytest.raises(TemplateError, match=r"broken\.jinja:\d+: template syntax error"):
        load_template(path)


def test_unknown_template_lists_shipped_ones():
    with pytest.raises(TemplateError, match="no template 'teacher/nope'.*teacher/reference_answer"):
        load_template("teacher/nope")


def test_system_block_and_student_system_inheritance(tmp_path):
    (tmp_path / "student.jinja").write_text(
        "{% block system %}You are a careful solver.{% endblock %}{% block user %}{{ prompt }}{% endblock %}"
    )
    (tmp_path / "own_system.jinja").write_text(
        "{% block system %}You know the answer is {{ answer }}.{% endblock %}{% block user %}{{ student_prompt }}{% endblock %}"
    )
    student = render_student(load_template(tmp_path / "student.jinja"), FULL)
    assert student == [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": FULL.prompt},
    ]
    inherited = render_teacher(load_template("teacher/empty"), FULL, student)
    assert inherited == student
    own = render_teacher(load_template(tmp_path / "own_system.jinja"), FULL, student)
    assert own[0] == {"role": "system", "content": "You know the answer is 7."}
    assert own[1] == {"role": "user", "content": FULL.prompt}


def test_template_variables_are_reported():
    assert load_template("teacher/verifier_feedback").variables == {"student_prompt", "attempt", "feedback"}
    assert load_template("student/plain").variables == {"prompt"}


def test_the_role_chat_template_arguments_reach_the_prompt_ids(smollm2_dir, smollm2_tokenizer):
    """model.chat_template_kwargs: a thinking template's generation prompt with enable_thinking = false
    ends with the empty think block; without arguments it is SmolLM2's own prompt, id for id."""
    from selfopd.templating.templates import prompt_token_ids
    from tests.thinking_template import EMPTY_THINK, thinking_tokenizer

    thinking = thinking_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    default = prompt_token_ids(thinking, messages)
    assert default == prompt_token_ids(smollm2_tokenizer, messages)
    off = prompt_token_ids(thinking, messages, {"enable_thinking": False})
    assert off[: len(default)] == default and thinking.decode(off[len(default):]) == EMPTY_THINK
    assert prompt_token_ids(thinking, messages, {"enable_thinking": True}) == default


@pytest.mark.parametrize("name, text", [
    # OPSD (github.com/siyan-zhao/OPSD): data_collator.py's student message, eval/evaluate_math.py's eval prompt
    ("student/opsd", "Problem: {p}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
    ("student/opsd_eval", "{p}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
    # nanopd/evaluate.py: the question + "\nPlease reason step by step, and put your final answer within \boxed{}."
    ("student/step_by_step_boxed", "{p}\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
])
def test_the_sources_prompts_render_as_the_sources_wrote_them(name, text):
    """The shipped templates of the sources' training and eval prompts: character for character the
    string each source's code builds (the whitespace between question and instruction included)."""
    assert render_student(load_template(name), FULL) == [{"role": "user", "content": text.format(p=FULL.prompt)}]


def test_opsds_teacher_prompt_renders_as_its_data_collator_builds_it():
    """teacher/opsd against the string OPSD's data_collator.py (at 7448751) builds, piece for piece: the reference
    solution between markers, the transition text (an em dash in it), the student's instruction."""
    transition = ("\n\nAfter reading the reference solution above, make sure you truly understand "
                  "the reasoning behind each step \u2014 do not copy or paraphrase it. Now, using your "
                  "own words and independent reasoning, derive the same final answer to the problem above. "
                  "Think step by step, explore different approaches, and don't be afraid to backtrack "
                  "or reconsider if something doesn't work out:\n")
    problem, solution = FULL.prompt, FULL.solution
    expected = (f"Problem: {problem}\n\n" f"Here is a reference solution to this problem:\n"
                f"=== Reference Solution Begin ===\n{solution}\n=== Reference Solution End ===\n"
                f"{transition}\n" f"Please reason step by step, and put your final answer within \\boxed{{}}.")
    student = render_student(load_template("student/opsd"), FULL)
    assert render_teacher(load_template("teacher/opsd"), FULL, student) == [{"role": "user", "content": expected}]
