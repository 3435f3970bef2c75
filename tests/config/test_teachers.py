"""selfopd.config.teachers: the teachers' chat-template arguments. A teacher's
chat_template_kwargs are merged over the student's (model.chat_template_kwargs): empty, it
prompts exactly as the student's settings do; [teachers.NAME] tables take their own."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, config_to_toml, load_config
from selfopd.config.teachers import chat_kwargs

TWO_TEACHERS = ["teachers.big.kind=frozen", "teachers.big.tasks=kb:countries"]


def test_the_teacher_follows_the_students_arguments_unless_it_sets_its_own():
    config = load_config(None, ["model.chat_template_kwargs=enable_thinking=false,depth=2", *TWO_TEACHERS,
                                "teachers.big.chat_template_kwargs=enable_thinking=true"])
    student = {"enable_thinking": False, "depth": 2}
    assert chat_kwargs(config) == (student, student)
    assert chat_kwargs(config, config.teachers["big"]) == (student, {"enable_thinking": True, "depth": 2})
    own = load_config(None, ["teacher.chat_template_kwargs=enable_thinking=true"])
    assert chat_kwargs(own) == ({}, {"enable_thinking": True})
    assert chat_kwargs(load_config(None)) == ({}, {})


def test_the_arguments_survive_the_run_folders_config_file(tmp_path):
    config = load_config(None, ["model.chat_template_kwargs=enable_thinking=false,style=brief,t=0.5", *TWO_TEACHERS,
                                "teachers.big.chat_template_kwargs=enable_thinking=true"])
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config
    assert load_config(path).model.chat_template_kwargs == {"enable_thinking": False, "style": "brief", "t": 0.5}


@pytest.mark.parametrize("override, key", [
    ("teacher.chat_template_kwargs=tokenize=true", "teacher.chat_template_kwargs.tokenize"),
    ("teachers.big.chat_template_kwargs=add_generation_prompt=false", "teachers.big.chat_template_kwargs.add_generation_prompt"),
    ("teacher.chat_template_kwargs=enable-thinking=false", "teacher.chat_template_kwargs"),
])
def test_a_bad_teacher_argument_is_one_line_naming_its_key(override, key):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*TWO_TEACHERS, override])
    assert error.value.key == key and "\n" not in str(error.value) and override in str(error.value)
