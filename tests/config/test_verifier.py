"""The `[verifier]` section: defaults, its checks (one line naming the key), and the Grading it hands
the verifiers."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, config_to_toml, load_config
from selfopd.verifiers import Grading


def test_defaults_read_thinking_blocks_and_count_truncated_answers_wrong(tmp_path):
    config = load_config(None)
    assert Grading.of(config.verifier) == Grading("<think>", "</think>", "wrong")
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_settings_reach_the_grading():
    config = load_config(None, ["verifier.truncated=grade", "verifier.reasoning_start=", "verifier.reasoning_end="])
    assert Grading.of(config.verifier) == Grading("", "", "grade")


@pytest.mark.parametrize("sets, message", [
    (["verifier.truncated=maybe"], r"verifier\.truncated: must be one of 'wrong', 'grade', got 'maybe'"),
    (["verifier.reasoning_end="], r"verifier\.reasoning_end: is empty while the other delimiter is set"),
    (["verifier.reasoning_start= "], r"verifier\.reasoning_start: is empty while the other delimiter is set"),
    (["verifier.reasoning_end=<think>"], r"verifier\.reasoning_end: must differ from verifier\.reasoning_start"),
    (["verifier.reasoning_start=<think>\u202e"], r"verifier\.reasoning_start: holds the invisible or control character"),
])
def test_a_bad_setting_is_one_line_naming_its_key(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)
