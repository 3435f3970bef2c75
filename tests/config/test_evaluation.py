"""The `[eval]` section's prompt and grading settings (`selfopd.config.evaluation`): empty by default,
where they change nothing of training's template, chat-template arguments and [verifier]; set, each
changes exactly its part; a bad value is one line naming its key."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, VerifierConfig, config_to_toml, load_config


def test_the_defaults_are_trainings_template_arguments_and_grading(tmp_path):
    config = load_config(None, ["data.student_template=student/boxed", "model.chat_template_kwargs=enable_thinking=false",
                                "verifier.truncated=grade"])
    settings = config.eval
    assert (settings.student_template, settings.chat_template_kwargs, settings.truncated, settings.reasoning) == (
        "", {}, "", "")
    assert settings.template(config.data.student_template) == "student/boxed"
    assert settings.template_kwargs(config.model.chat_template_kwargs) == {"enable_thinking": False}
    assert settings.grading(config.verifier) == config.verifier
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_each_setting_changes_its_part_only():
    base = ["data.student_template=student/opsd", "model.chat_template_kwargs=enable_thinking=false,style=terse"]
    config = load_config(None, [*base, "eval.student_template=student/opsd_eval",
                                "eval.chat_template_kwargs=enable_thinking=true"])
    assert config.eval.template(config.data.student_template) == "student/opsd_eval"
    assert config.eval.template_kwargs(config.model.chat_template_kwargs) == {"enable_thinking": True, "style": "terse"}
    assert config.model.chat_template_kwargs == {"enable_thinking": False, "style": "terse"}  # training's unchanged
    assert config.eval.grading(config.verifier) == config.verifier

    truncated = load_config(None, ["eval.truncated=grade"])
    assert truncated.eval.grading(truncated.verifier) == VerifierConfig(truncated="grade")
    assert truncated.verifier.truncated == "wrong"  # training's rewards still count a cut answer wrong
    kept = load_config(None, ["verifier.truncated=grade", "eval.truncated=wrong"])
    assert kept.eval.grading(kept.verifier).truncated == "wrong"

    graded = load_config(None, ["eval.reasoning=graded"]).eval.grading(load_config(None).verifier)
    assert (graded.reasoning_start, graded.reasoning_end, graded.truncated) == ("", "", "wrong")


@pytest.mark.parametrize("sets, message", [
    (["eval.truncated=maybe"], r"^--set eval\.truncated=maybe: eval\.truncated: must be one of '', 'wrong', 'grade', "
                               r"got 'maybe'$"),
    (["eval.reasoning=all"], r"^--set eval\.reasoning=all: eval\.reasoning: must be one of '', 'graded', got 'all'$"),
    (["eval.chat_template_kwargs=tokenize=true"],
     r"eval\.chat_template_kwargs\.tokenize: is an argument selfopd passes to apply_chat_template itself"),
    (["eval.student_template=student/plain\u202e"], r"eval\.student_template: holds the invisible or control character"),
])
def test_a_bad_setting_is_one_line_naming_its_key(sets, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, sets)
    assert "\n" not in str(error.value)
