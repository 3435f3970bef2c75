"""The checks every setting's value passes: range messages that name the bound broken, and text
shown escaped when it holds a character a reader cannot see."""

from __future__ import annotations

import pytest

from selfopd.config.checks import Bounds, ConfigError, check_folder_name, escaped, hidden_characters


def test_a_range_message_names_the_bound_broken():
    assert str(Bounds(gt=0, le=1)) == "(0, 1]" and str(Bounds(ge=1, most=10)) == "[1, 10]"
    with pytest.raises(ConfigError, match=r"^x: must be in \(0, 1\], got 1\.5$"):
        Bounds(gt=0, le=1).check("x", 1.5)
    with pytest.raises(ConfigError, match=r"^x: must be >= 1, got 0$"):
        Bounds(ge=1, most=10).check("x", 0)
    with pytest.raises(ConfigError, match=r"^x: must be <= 10 \(a sane maximum\), got an integer of 40 digits$"):
        Bounds(ge=1, most=10).check("x", 10**39)


def test_hidden_characters_are_shown_escaped_and_visible_text_is_left_alone():
    text = "run\u202e\x1b[0m\u200b\t\n é 日本"
    assert hidden_characters(text) == ["\u202e", "\x1b", "\u200b"]
    assert escaped(text) == "run\\u202e\\x1b[0m\\u200b\\t\\n é 日本"
    assert not hidden_characters(escaped(text), allow="")


@pytest.mark.parametrize("name, words", [("", "must not be empty"), (" ", "must not be empty"), ("..", "plain folder"),
                                         ("a/b", "plain folder"), ("a\\b", "plain folder"),
                                         ("a\u202eb", r"U\+202E"), ("x" * 201, "at most 200 bytes")])
def test_a_folder_name_is_one_plain_visible_component(name, words):
    with pytest.raises(ConfigError, match=words):
        check_folder_name("run.name", name)
