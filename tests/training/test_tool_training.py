"""Training on tool-calling episodes (`rollout.environment = 'tools'`): a student whose chat template
has no tools is refused before the run folder is made, and a run's student and teacher prompts carry
the same tool definitions through a training step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfopd.config import load_config
from selfopd.config.settings import ConfigError
from selfopd.training.rollout_pipeline import request_for_step
from selfopd.training.trainer import build_run, train_step
from tests.tool_templates import HERMES_TEMPLATE, tool_model_dir

SMALL = [
    "data.spec=rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&size=40&seed=3",
    "data.eval_size=4",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_tokens=8",
    "rollout.environment=tools",
    "rollout.tools=calculator,python",
    "rollout.max_turns=2",
    "rollout.max_episode_tokens=40",
    "optim.micro_batch_prompts=1",
    "run.progress=false",
    "run.eval_every=0",
]


def _config(tmp_path: Path, model: Path | str, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def test_a_student_template_without_tools_is_refused_before_the_run_folder_is_made(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^rollout.environment: 'tools': .*its chat template never reads `tools`") as raised:
        build_run(_config(tmp_path, tiny_model_dir, "run.name=refused"))
    assert str(tiny_model_dir) in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "refused").exists()


def test_a_step_on_tool_episodes_prompts_the_student_and_the_teacher_with_the_same_tools(tmp_path, tiny_model_dir):
    model = tool_model_dir(tiny_model_dir, tmp_path / "model", HERMES_TEMPLATE)
    run = build_run(_config(tmp_path, model, "run.name=tools"))
    try:
        tools = run.student_chat.template_kwargs["tools"]
        assert [t["function"]["name"] for t in tools] == ["calculator", "python"]
        assert run.teacher.chat.template_kwargs["tools"] == tools and run.episodes.chat.template_kwargs["tools"] == tools
        request = request_for_step(run.student_side, 0)
        shown = run.tokenizer.decode(request.prompts[0])
        assert '"name": "calculator"' in shown and '"name": "python"' in shown  # what the student is prompted with
        messages = [{"role": "user", "content": request.examples[0].prompt}]
        assert '"name": "python"' in run.tokenizer.decode(run.teacher.prompt_ids(messages))  # and the teacher
        metrics = train_step(run)
        assert metrics["tokens/completion"] > 0 and torch.isfinite(torch.tensor(metrics["loss/pg"]))
    finally:
        run.close()


def test_a_run_on_a_trl_class_trains_and_evaluates_in_its_episodes(tmp_path, tiny_model_dir):
    """rollout.environment = 'trl:...': the class's method is the one tool in the run's prompts, a step trains on
    its episodes, and the in-run eval plays episodes too (the tool in its prompts), graded by get_reward."""
    import json

    from selfopd.training.trainer import train

    model = tool_model_dir(tiny_model_dir, tmp_path / "model", HERMES_TEMPLATE)
    config = _config(tmp_path, model, "run.name=trl", "rollout.environment=trl:tests.episodes.trl_envs:FindNumber",
                     "run.steps=1", "run.eval_every=1", "eval.max_tokens=8")
    run = build_run(config)
    try:
        assert [t["function"]["name"] for t in run.student_chat.template_kwargs["tools"]] == ["guess"]
        assert run.teacher.chat.template_kwargs["tools"] == run.student_chat.template_kwargs["tools"]
    finally:
        run.close()
    folder = train(config)
    records = [json.loads(line) for line in (folder / "eval" / "step_00001" / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["id"] for r in records} == {e.id for e in run.eval_examples}
    assert json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
