"""`selfopd prompts render | lint` with chat-template arguments: render shows each role's
arguments and what its generation prompt adds, and counts tokens with them; lint warns when the
teacher's arguments move the point it scores from (a thinking-style template written for the
tests, `tests.thinking_template`)."""

from __future__ import annotations

import re

import pytest

from selfopd.cli import main
from tests.thinking_template import thinking_model_dir


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory, tiny_model_dir):
    return thinking_model_dir(tiny_model_dir, tmp_path_factory.mktemp("thinking") / "model")


def _render(capsys, *args: str) -> list[str]:
    assert not main(["prompts", "render", "teacher/reference_answer", *args])
    return capsys.readouterr().out.splitlines()


def test_render_shows_and_uses_each_roles_arguments(capsys, thinking_dir, tmp_path):
    plain = _render(capsys, "--model", str(thinking_dir))
    assert "student chat_template_kwargs: none; the generation prompt adds '<|im_start|>assistant\\n'" in plain
    off = _render(capsys, "--model", str(thinking_dir), "--set", "model.chat_template_kwargs=enable_thinking=false")
    think = "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'"
    assert f"student chat_template_kwargs: enable_thinking=False; the generation prompt adds {think}" in off
    assert f"teacher chat_template_kwargs: enable_thinking=False; the generation prompt adds {think}" in off  # follows
    counts = [[int(n) for n in re.findall(r"\[(\d+) tokens\]", lines[1])] for lines in (plain, off)]
    assert [n - 9 for n in counts[1]] == counts[0]  # the empty think block's 9 tokens, in both prompts
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\nstudent = "{thinking_dir}"\nchat_template_kwargs = {{enable_thinking = false}}\n'
                      '[teacher]\nchat_template_kwargs = {enable_thinking = true}\n')
    own = _render(capsys, "--config", str(config))
    assert f"student chat_template_kwargs: enable_thinking=False; the generation prompt adds {think}" in own
    assert "teacher chat_template_kwargs: enable_thinking=True; the generation prompt adds '<|im_start|>assistant\\n'" in own


def test_lint_warns_when_the_teacher_scores_from_another_point(capsys, thinking_dir):
    argv = ["prompts", "lint", "teacher/reference_answer", "--model", str(thinking_dir)]
    assert main([*argv, "--set", "model.chat_template_kwargs=enable_thinking=false"]) == 0
    out = capsys.readouterr().out
    assert "chat_template_kwargs" not in out and out.rstrip().endswith("0 warnings")
    assert main([*argv, "--set", "model.chat_template_kwargs=enable_thinking=false",
                 "--set", "teacher.chat_template_kwargs=enable_thinking=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    warning = [line for line in lines if line.startswith("warning: teacher.chat_template_kwargs: ")]
    assert len(warning) == 1 and "</think>" in warning[0] and lines[-1].endswith("1 warnings")
