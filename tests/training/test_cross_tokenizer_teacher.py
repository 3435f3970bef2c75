"""A teacher with its own tokenizer (`teacher.tokenizer = 'own'`) in the trainer: the same
tokenizer gives bit-identical numbers to scoring the student's ids; another one trains, its
logprobs carried onto the student's tokens with the span sums exact; misreadable completions are
masked and counted; bad settings and chat templates are refused at start."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from experiments.cross_tokenizer.tokenizer import train_tokenizer
from selfopd.config import ConfigError, load_config
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.templating.templates import prompt_token_ids, render_student, render_teacher
from selfopd.training.teacher import score_rows, teacher_rows
from selfopd.training.trainer import build_run, train
from tests.training.test_trainer import _config, _lines, _without_times

CORPUS = ["What is 12 + 30? The answer is 42.", "Add 7 and 35 to get 42.", "Compute 3 + 4: it is 7."] * 30


def _teacher(folder, tokenizer, seed=1):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _rollouts(run_dir, step=1):
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:05d}.jsonl").read_text().splitlines()]


def test_own_tokenizer_equal_to_the_students_is_bit_identical(tmp_path, tiny_model_dir, smollm2_tokenizer):
    teacher = _teacher(tmp_path / "teacher", smollm2_tokenizer)
    external = ["teacher.kind=external", f"teacher.model={teacher}", "run.steps=2"]
    ids_run = train(_config(tmp_path, tiny_model_dir, *external, "run.name=ids"))
    own_run = train(_config(tmp_path, tiny_model_dir, *external, "teacher.tokenizer=own", "run.name=own"))
    own = [_without_times(m) for m in _lines(own_run)]
    assert all(m.pop("teacher/unaligned_share", 0.0) == 0.0 for m in own)
    assert own == [_without_times(m) for m in _lines(ids_run)]
    for step in (1, 2):
        assert [r["teacher_logprobs"] for r in _rollouts(own_run, step)] == [r["teacher_logprobs"] for r in _rollouts(ids_run, step)]


def test_teacher_with_another_tokenizer_scores_the_students_text(tmp_path, tiny_model_dir, smollm2_tokenizer):
    bpe = train_tokenizer(CORPUS, vocab_size=300)
    teacher_dir = _teacher(tmp_path / "bpe-teacher", bpe)
    config = _config(tmp_path, tiny_model_dir, "teacher.kind=external", f"teacher.model={teacher_dir}",
                     "teacher.tokenizer=own", "run.steps=1", "run.name=cross", "rollout.max_tokens=12")
    run = build_run(config)
    try:
        assert not run.teacher.bridge.shared_ids and bpe.convert_ids_to_tokens(run.teacher.bridge.teacher_end) == "<|end|>"
        examples = run.train_examples[:2]
        messages = [render_student(run.student_template, e) for e in examples]
        groups = run.student_engine.sample([prompt_token_ids(run.tokenizer, m) for m in messages],
                                           SamplingParams(max_tokens=12, n=3, seed=0))
        rows = teacher_rows(run.teacher, 0, examples, messages, groups, 0)
        scored, _ = score_rows(run.teacher, rows, 0)
        independent = LocalEngine(run.teacher.engine.model, bpe, batch_size=1)  # one row at a time: no padding
        for row, s in zip(rows, scored):
            assert len(s.teacher_logprobs) == len(row.rollout.completion_ids)
            assert row.prompt_ids == run.teacher.bridge.prompt_ids(render_teacher(run.teacher.template, row.example, messages[row.group]))
            assert bpe.decode(row.prompt_ids).startswith("<|system|>") or bpe.decode(row.prompt_ids).startswith("<|user|>")
            if not s.aligned:
                continue
            # The student's per-token values add up to the teacher's logprob of its own tokens of the text.
            [alone] = independent.score([(row.prompt_ids, row.teacher_completion)])
            assert s.teacher_logprobs.double().sum().item() == pytest.approx(alone.logprobs.double().sum().item(), abs=1e-4)
        assert any(s.aligned for s in scored)
    finally:
        run.close()
    run_dir = train(config)
    [metrics] = [m for m in _lines(run_dir) if "loss/pg" in m]
    assert 0.0 <= metrics["teacher/unaligned_share"] <= 1.0 and math.isfinite(metrics["loss/pg"])
    assert all(len(r["teacher_logprobs"]) == len(r["completion_ids"]) for r in _rollouts(run_dir))


def test_a_completion_the_teacher_cannot_read_gets_no_teacher_signal(tmp_path, tiny_model_dir):
    lower = train_tokenizer(CORPUS, vocab_size=300, lowercase=True)
    teacher_dir = _teacher(tmp_path / "lower-teacher", lower)
    run_dir = train(_config(tmp_path, tiny_model_dir, "teacher.kind=external", f"teacher.model={teacher_dir}",
                            "teacher.tokenizer=own", "run.steps=1", "run.name=lower", "rollout.max_tokens=12",
                            "rollout.samples_per_prompt=4"))
    [metrics] = [m for m in _lines(run_dir) if "loss/pg" in m]
    assert metrics["teacher/unaligned_share"] > 0  # a random student writes capitals, which this teacher lowercases
    masked = [r for r in _rollouts(run_dir) if r.get("unaligned")]
    assert masked and all("does not re-encode" in r["unaligned"] or "special token" in r["unaligned"] for r in masked)
    for r in masked:  # no teacher signal: the placeholder is the sampler's own logprobs
        assert r["teacher_logprobs"] == pytest.approx(r["sampler_logprobs"])


@pytest.mark.parametrize("settings, key", [
    (["teacher.tokenizer=own"], "teacher.tokenizer"),
    (["teacher.kind=external", "teacher.model=x", "teacher.tokenizer=own", "loss.divergence=topk_reverse_kl"],
     "loss.divergence"),
    (["teacher.kind=external", "teacher.model=x", "teacher.tokenizer=own", "loss.divergence=reverse_kl"],
     "loss.divergence"),
])
def test_settings_an_own_tokenizer_cannot_serve_are_refused(settings, key):
    with pytest.raises(ConfigError) as error:
        load_config(None, settings)
    assert error.value.key == key


def test_a_teacher_chat_template_with_a_bad_boundary_is_refused_at_start(tmp_path, tiny_model_dir):
    bpe = train_tokenizer(CORPUS, vocab_size=300)
    bpe.chat_template = bpe.chat_template.replace("<|assistant|>\n{% endif %}", "<|assistant|>\n<|system|>{% endif %}")
    teacher_dir = _teacher(tmp_path / "bad-template", bpe)
    with pytest.raises(ConfigError, match="teacher.tokenizer: 'own': .*generation prompt is not how"):
        build_run(_config(tmp_path, tiny_model_dir, "teacher.kind=external", f"teacher.model={teacher_dir}",
                          "teacher.tokenizer=own", "run.name=bad"))
    assert not (tmp_path / "bad").exists()  # refused before the run folder is claimed
