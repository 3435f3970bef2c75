"""The `ema` teacher: the average against a float64 reference, rates 1 and 0 that are
exactly the `self` and `frozen` teachers, a teacher engine that is sent the average (as a
vLLM server is) and the probe that proves it serves the average, not the student."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from selfopd.config import DEFAULT_TEACHER, ConfigError, load_config
from selfopd.training.ema import EmaWeights
from selfopd.engines.local import LocalEngine
from selfopd.training.trainer import WeightSyncError, build_run, train, train_step
from selfopd.run.tracking import untimed

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
    "run.progress=false", "run.eval_every=0", "model.threads=1", "teacher.template=teacher/answer_note",
]


def _config(tmp_path: Path, model: Path, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in untimed(line).items() if k != "teacher/ema_distance"}
            for line in lines if "loss/pg" in line]


def test_the_average_follows_a_float64_reference_and_is_exact_at_rates_1_and_0():
    torch.manual_seed(0)
    student, copy = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    start = {n: p.detach().double().clone() for n, p in copy.named_parameters()}
    ema = EmaWeights(copy, 0.3)
    reference = dict(start)
    for _ in range(3):
        with torch.no_grad():
            for p in student.parameters():
                p.add_(torch.randn_like(p))
        ema.update(student)
        reference = {n: 0.7 * reference[n] + 0.3 * p.detach().double() for n, p in student.named_parameters()}
        for name, param in copy.named_parameters():
            assert torch.allclose(param.double(), reference[name], rtol=0, atol=1e-6), name
    gap = sum((reference[n] - p.detach().double()).square().sum() for n, p in student.named_parameters()).sqrt()
    norm = sum(p.detach().double().square().sum() for p in student.parameters()).sqrt()
    assert ema.distance(student) == pytest.approx((gap / norm).item(), rel=1e-5)
    saved = ema.state_dict()
    EmaWeights(copy, 1.0).update(student)  # rate 1: exactly the student
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), student.parameters()))
    assert ema.distance(student) == 0.0
    ema.load_state_dict(saved)
    EmaWeights(copy, 0.0).update(student)  # rate 0: exactly unchanged
    assert all(torch.equal(p, saved[n]) for n, p in copy.named_parameters())


@pytest.mark.parametrize("rate, same_as", [(1.0, "self"), (0.0, "frozen")])
def test_rates_1_and_0_are_exactly_the_self_and_frozen_teachers(tmp_path, tiny_model_dir, rate, same_as):
    ema = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=ema", "teacher.kind=ema",
                        f"teacher.ema_rate={rate}"))
    other = train(_config(tmp_path, tiny_model_dir, "run.steps=2", f"run.name={same_as}", f"teacher.kind={same_as}"))
    assert _steps(ema) == _steps(other)
    assert _steps(ema)[0]["opd/reverse_kl"] != 0  # the answer note gives the teacher something to add
    distances = [json.loads(line).get("teacher/ema_distance") for line in (ema / "metrics.jsonl").read_text().splitlines()]
    distances = [d for d in distances if d is not None]
    assert len(distances) == 2 and (all(d == 0.0 for d in distances) if rate == 1 else all(d > 0 for d in distances))


def test_a_teacher_server_is_sent_the_average_and_the_probe_proves_it(tmp_path, tiny_model_dir):
    """A teacher engine on its own copy of the weights (as a vLLM teacher server is) gets the
    average after each step; one that is given the student's weights instead, or drops the
    update, stops the run at the probe."""
    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=served", "teacher.kind=ema", "teacher.ema_rate=0.5"))
    run.run_dir.mkdir(parents=True)
    server_copy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    run.teachers[DEFAULT_TEACHER] = dataclasses.replace(run.teacher, engine=LocalEngine(server_copy, run.tokenizer))
    metrics = train_step(run)
    assert metrics["probe/max_abs_diff"] == 0.0 and metrics["teacher/ema_distance"] > 0
    for name, param in server_copy.named_parameters():
        assert torch.equal(param, run.ema.model.get_parameter(name)), name

    class StudentWeightsEngine(LocalEngine):  # a sync that sends the student's weights, not the average
        def update_weights(self, named_tensors, version):
            super().update_weights({n: p.detach() for n, p in run.model.named_parameters()}, version)

    run.teachers[DEFAULT_TEACHER] = dataclasses.replace(run.teacher, engine=StudentWeightsEngine(server_copy, run.tokenizer))
    with pytest.raises(WeightSyncError, match=r"after step 2 the ema teacher engine's logprobs .* differ from the "
                                              r"trainer's EMA weights'"):
        train_step(run)


def test_ema_with_lora_is_refused_naming_both_keys(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"teacher.kind: 'ema' with model.lora_rank > 0 is not supported"):
        _config(tmp_path, tiny_model_dir, "teacher.kind=ema", "model.lora_rank=4")
