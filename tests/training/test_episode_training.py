"""Training on episodes (`rollout.environment = 'retry_feedback'`): the step runs end to end, the
environment's ids are never trained, a self-teacher with an empty context gives exactly zero advantage
on every student token, and a resumed run continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfopd.config import load_config
from selfopd.training.trainer import build_run, train, train_step
from selfopd.run.tracking import untimed

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2",
    "data.eval_size=4",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_tokens=8",
    "rollout.environment=retry_feedback",
    "rollout.max_turns=3",
    "rollout.max_episode_tokens=80",
    "optim.micro_batch_prompts=1",
    "optim.lr=1e-3",
    "run.progress=false",
    "run.eval_every=0",
]


def _config(tmp_path: Path, model: Path | str, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_step_on_episodes_samples_several_turns_and_trains_the_students_ids_only(tmp_path, tiny_model_dir):
    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=episodes"))
    sampled = run.episodes.sample(run.student_engine, [run.student_chat.prompt_ids([{"role": "user", "content": "1+1="}])],
                                  run.train_examples[:1], _params(run))
    (group,) = sampled
    assert len(group) == 2 and all(r.loss_mask is not None for r in group)
    assert any(not all(r.loss_mask) for r in group), "no episode reached a second turn (a random model always errs)"
    metrics = train_step(run)
    assert metrics["tokens/completion"] > 0 and torch.isfinite(torch.tensor(metrics["loss/pg"]))


def _params(run):
    from selfopd.training.rollout_pipeline import request_for_step

    return request_for_step(run.student_side, 0).params


def test_a_self_teacher_with_an_empty_context_gives_zero_advantage_on_every_student_token_of_an_episode(tmp_path, smollm2_dir):
    run = build_run(_config(tmp_path, "smollm2-135m-instruct", "teacher.template=teacher/empty", "run.name=zero",
                            "rollout.temperature=1.0"))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert metrics["episode/turns_mean"] > 1 and metrics["episode/environment_share"] > 0  # several turns trained
    assert metrics["opd/advantage_mean"] == 0.0 and metrics["opd/advantage_std"] == 0.0
    assert metrics["opd/reverse_kl"] == 0.0 and metrics["loss/pg"] == 0.0
    for name, param in run.model.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.slow
def test_a_resumed_run_on_episodes_continues_exactly(tmp_path, tiny_model_dir):
    whole = train(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=whole"))
    part = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=part", "run.checkpoint_every=1"))
    resumed = train(load_config(part / "config.toml", ["run.steps=3"]), resume=True)
    step3 = [untimed(m) for m in _lines(whole) if m["step"] == 3 and "loss/pg" in m]
    again = [untimed(m) for m in _lines(resumed) if m["step"] == 3 and "loss/pg" in m]
    assert step3 == again and len(step3) == 1


def test_a_code_task_reports_shown_and_hidden_test_rewards_per_step(tmp_path, tiny_model_dir):
    """The tiny random model writes no program: every rollout fails shown and hidden tests, and the
    step still logs both side by side (the sandbox ran nothing it was not given)."""
    run = build_run(load_config(None, [
        "data.spec=codegen?level=1&size=40&seed=3", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_tokens=8", "optim.micro_batch_prompts=1",
        "run.progress=false", "run.eval_every=0", "teacher.template=teacher/sibling",
        "teacher.demonstration_fallback=teacher/code_feedback",
        f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=code"]))
    metrics = train_step(run)
    assert metrics["reward/shown_tests"] == metrics["reward/hidden_tests"] == 0.0
    assert metrics["reward/hidden_gap"] == 0.0 and torch.isfinite(torch.tensor(metrics["loss/pg"]))


def test_episodes_with_a_teacher_of_its_own_tokenizer_are_refused():
    from selfopd.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.environment: 'retry_feedback' with a teacher of its own tokenizer"):
        load_config(None, ["rollout.environment=retry_feedback", "teacher.kind=external", "teacher.model=org/x",
                           "teacher.tokenizer=own", "loss.divergence=sampled"])
