"""The parser every sub-command shares: a refused flag is one line, `selfopd: error: ...`, exit
code 1, as every other bad input; a number flag takes what its config setting takes."""

from __future__ import annotations

import argparse
import re

import pytest

from selfopd.cli import main
from selfopd.cli.common import like_setting
from selfopd.config import RolloutConfig


@pytest.mark.parametrize("argv, message", [
    (["eval", "--no-such-flag"], r"unrecognized arguments: --no-such-flag \(see `selfopd --help`\)"),
    (["no-such-command"], r"argument COMMAND: invalid choice: 'no-such-command'"),
    (["eval", "--split", "test"], r"argument --split: invalid choice: 'test'"),
    (["data", "show", "--limit", "-1"], r"argument --limit: must be >= 0, got -1 \(see `selfopd data show --help`\)"),
    (["diagnose", "runs/x", "--gap-items", "-5"], r"argument --gap-items: must be >= 0, got -5"),
    (["diagnose", "runs/x", "--heatmaps", "nan"], r"argument --heatmaps: expected an integer, got 'nan'"),
    (["diagnose", "runs/x", "--transfer-items", str(10**30)], r"argument --transfer-items: must be <= 100000000 "
                                                              r"\(a sane maximum\)"),
    (["eval", "--samples=\u202e3"], r"argument --samples: expected an integer, got '\\u202e3'"),    (["drift", "--samples", "0"], r"argument --samples: must be >= 1, got 0"),
    (["drift", "--max-tokens", "-3"], r"argument --max-tokens: must be >= 1, got -3"),
    (["drift", "--seed", str(2**63)], r"argument --seed: must be <= \d+"),
])
def test_a_refused_flag_is_one_line_and_exit_code_1(argv, message, capsys):
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("selfopd: error: ") and not captured.out, captured.err
    assert re.search(message, lines[0]), lines[0]


def test_help_still_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0 and "--samples" in capsys.readouterr().out


def test_a_number_flag_takes_what_its_setting_takes():
    temperature = like_setting(RolloutConfig, "temperature")
    assert temperature("0") == 0.0 and temperature("100") == 100.0
    for text, words in [("nan", "must be finite"), ("100.5", "a sane maximum"), ("-1e-9", "must be >= 0.0"),
                        ("warm", "expected a number")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            temperature(text)
