"""The trainer end to end: plumbing on a tiny model, exact-zero control and sync probe on the real one."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from selfopd.config import DEFAULT_TEACHER, load_config
from selfopd.engines.local import LocalEngine
from selfopd.engines.build import load_model
from selfopd.engines.scoring import completion_hidden
from selfopd.training.weight_checks import check_probe
from selfopd.templating.tokenizer_check import TokenizerMismatch
from selfopd.training.trainer import WeightSyncError, build_run, train, train_step
from selfopd.run.tracking import untimed

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2",
    "data.eval_size=4",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1",
    "optim.lr=1e-3",
    "eval.max_tokens=6",
    "eval.batch_size=4",
    "run.progress=false",
    "run.eval_every=0",
]


def _config(tmp_path: Path, model: Path | str, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_times(metrics: dict) -> dict:
    return untimed(metrics)


def test_run_writes_metrics_checkpoint_rollouts_and_plots(tmp_path, tiny_model_dir):
    run_dir = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=plumbing"))
    lines = _lines(run_dir)
    steps = [line for line in lines if "loss/pg" in line]
    evals = [line for line in lines if "eval/accuracy" in line]
    assert [m["step"] for m in steps] == [1, 2] and [m["step"] for m in evals] == [0, 2]
    for key in ("opd/reverse_kl", "opd/advantage_mean", "opd/advantage_std", "opd/positive_advantage_share",
                "reward/mean", "reward/accuracy", "verify/rejected_share", "verify/no_answer_share", "rollout/length_mean",
                "rollout/truncated_share",
                "is/sampler_logprob_abs_diff", "optim/grad_norm",
                "time/sample", "time/teacher", "time/train", "time/optim", "time/sync", "time/probe", "time/step"):
        assert key in steps[0], key
    assert "probe/max_abs_diff" not in steps[0]  # in-process engines share the live module: nothing to probe
    # verifier.truncated = 'wrong': every answer cut at max_tokens has no answer graded, in training and in eval
    assert steps[0]["verify/no_answer_share"] >= steps[0]["rollout/truncated_share"] > 0
    assert evals[0]["eval/no_answer_share"] >= evals[0]["eval/truncated_share"] > 0
    checkpoint = run_dir / "checkpoints" / "step_00002"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    trained = dict(build_run(_config(tmp_path, tiny_model_dir, "run.name=plumbing"), checkpoint).model.named_parameters())
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, trained[name])
    rollouts = [json.loads(line) for line in (run_dir / "rollouts" / "step_00001.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and len(rollouts[0]["teacher_logprobs"]) == len(rollouts[0]["completion_ids"])
    assert {"loss.png", "kl.png", "accuracy.png"} <= {p.name for p in (run_dir / "plots").iterdir()}
    assert (run_dir / "eval" / "step_00000" / "eval.jsonl").is_file()


def test_same_seed_gives_same_metrics(tmp_path, tiny_model_dir):
    first = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=a"))
    second = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=b"))
    assert [_without_times(m) for m in _lines(first)] == [_without_times(m) for m in _lines(second)]
    other = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=c", "run.seed=1"))
    assert [_without_times(m) for m in _lines(other)] != [_without_times(m) for m in _lines(first)]


@pytest.mark.slow
@pytest.mark.parametrize("teacher", [(), ("teacher.kind=ema", "teacher.ema_rate=0.3")], ids=["self", "ema"])
def test_resumed_run_continues_exactly(tmp_path, tiny_model_dir, teacher):
    """Bit for bit; an `ema` teacher's average is restored from the checkpoint."""
    whole = train(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=whole", *teacher))
    part = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=part", "run.checkpoint_every=1", *teacher))
    resumed = train(load_config(part / "config.toml", ["run.steps=3"]), resume=True)
    step3 = [m for m in _lines(whole) if m["step"] == 3 and "loss/pg" in m]
    again = [m for m in _lines(resumed) if m["step"] == 3 and "loss/pg" in m]
    assert len(step3) == len(again) == 1
    assert _without_times(again[0]) == _without_times(step3[0])
    assert [m["step"] for m in _lines(resumed) if "loss/pg" in m] == [1, 2, 3]


def test_refuses_to_overwrite_a_run(tmp_path, tiny_model_dir):
    train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=once"))
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=once"))


def test_probe_stops_a_run_whose_engine_missed_the_update(tmp_path, tiny_model_dir):
    """An engine on a separate copy that ignores weight updates must be caught at once."""
    run = build_run(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=stale"))
    stale_copy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    class DroppingEngine(LocalEngine):
        def update_weights(self, named_tensors, version):  # a broken sync: nothing arrives
            self.version = version

    run.student_engine = DroppingEngine(stale_copy, run.tokenizer)
    with pytest.raises(WeightSyncError, match=r"after step 1 the student engine's logprobs \(in-process model\) differ"):
        train_step(run)


def test_bfloat16_probe_tells_bf16_noise_from_wrong_weights(tmp_path, tiny_model_dir):
    """In bf16 the probe compares the mean gap over its tokens (probe.bf16_tolerance): a bf16
    copy of the trainer's weights passes, another model's weights do not."""
    run = build_run(_config(tmp_path, tiny_model_dir, "model.dtype=bfloat16", "run.name=bf16_probe"))
    copy, _ = load_model(tiny_model_dir, "bfloat16", frozen=True)
    run.student_engine = LocalEngine(copy, run.tokenizer)  # a copy: gaps are bf16's, not 0 as in process
    gaps = check_probe(run)
    assert 0 < gaps["probe/mean_abs_diff"] <= run.config.probe.bf16_tolerance
    with torch.no_grad():  # wrong weights: a final norm 30x too large sharpens every distribution
        copy.model.norm.weight.mul_(30)
    with pytest.raises(WeightSyncError, match=r"the student engine's logprobs \(in-process model\) "
                                       r"differ from the trainer's: mean \|difference\| \(probe.bf16_tolerance = 0.25\)"):
        check_probe(run)


def test_external_teacher_with_other_vocabulary_is_refused(tmp_path, tiny_model_dir, smollm2_tokenizer):
    other = tmp_path / "other-teacher"
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    LlamaForCausalLM(config).save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    cfg = _config(tmp_path, tiny_model_dir, "teacher.kind=external", f"teacher.model={other}", "run.name=ext")
    with pytest.raises(TokenizerMismatch):
        build_run(cfg)


@pytest.mark.slow
def test_self_teacher_with_empty_context_gives_exactly_zero_advantage(tmp_path, smollm2_dir):
    """Same weights, same prompt: teacher and student logprobs are the same numbers, so the
    advantage, the loss and the update are exactly zero (on the real packaged model)."""
    run = build_run(_config(tmp_path, "smollm2-135m-instruct", "teacher.template=teacher/empty", "run.name=zero",
                            "rollout.temperature=1.0", "rollout.max_tokens=8"))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert metrics["opd/advantage_mean"] == 0.0 and metrics["opd/advantage_std"] == 0.0
    assert metrics["opd/reverse_kl"] == 0.0 and metrics["loss/pg"] == 0.0
    assert metrics["tokens/completion"] > 0
    for name, param in run.model.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.slow
def test_policy_is_the_sampling_distribution_at_any_temperature(tmp_path, smollm2_dir):
    """Sampling at T = 0.7: the trainer's logprobs are those of the tempered distribution the
    sampler drew from (importance ratio 1 up to fp32 noise, where raw logprobs would be off
    by far more), and the empty-context self teacher, scored at the same temperature, still
    gives exactly zero advantage."""
    run = build_run(_config(tmp_path, "smollm2-135m-instruct", "teacher.template=teacher/empty", "run.name=tempered",
                            "rollout.temperature=0.7", "rollout.max_tokens=8"))
    metrics = train_step(run)
    assert metrics["is/sampler_logprob_abs_diff"] < 1e-4
    assert metrics["opd/advantage_mean"] == 0.0 and metrics["opd/reverse_kl"] == 0.0
    (record, *_) = [json.loads(line) for line in (run.run_dir / "rollouts" / "step_00001.jsonl").read_text().splitlines()]
    raw = run.student_engine.score([(record["prompt_ids"], record["completion_ids"])])[0].logprobs
    assert (raw - torch.tensor(record["student_logprobs"])).abs().max() > 0.01


def test_tokenizer_without_pad_token_trains(tmp_path, tiny_model_dir):
    """Llama 3 tokenizers have no pad token: batches are padded with end-of-sequence instead."""
    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=nopad"))
    run.tokenizer.pad_token = None
    assert run.tokenizer.pad_token_id is None
    run.student_engine = LocalEngine(run.model, run.tokenizer)
    run.teachers[DEFAULT_TEACHER] = dataclasses.replace(run.teacher, engine=run.student_engine)
    metrics = train_step(run)
    assert math.isfinite(metrics["loss/pg"]) and run.pad_id == run.model.generation_config.eos_token_id


def test_bfloat16_run_trains_fp32_master_weights_in_bf16_compute(tmp_path, tiny_model_dir):
    """model.dtype = bfloat16: weights, gradients and AdamW state stay fp32, the forward runs
    in bf16, and a step at lr 1e-6 still moves the weights (a bf16 weight could not take it)."""
    run = build_run(_config(tmp_path, tiny_model_dir, "model.dtype=bfloat16", "optim.lr=1e-6", "run.name=bf16"))
    run.run_dir.mkdir(parents=True)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in run.optimizer.state.values())
    assert "probe/max_abs_diff" not in metrics  # the live module: nothing to probe
    moved = [(p != before[n]).float().mean().item() for n, p in run.model.named_parameters()]
    assert min(moved) > 0.9, moved  # every tensor: nearly every weight moved
    dtypes = []
    linear = run.model.get_decoder().layers[0].mlp.down_proj
    handle = linear.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    with run.autocast():
        completion_hidden(run.model, [([1, 2, 3], [4, 5]), ([1, 2, 3], [6])], run.pad_id)  # a shared prompt
    handle.remove()
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # prompt and completion passes: bf16 matmuls
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in before.items()}
    stepped = {n: (p.float() - 1e-6 * torch.sign(p.float())).to(torch.bfloat16) for n, p in bf16.items()}
    assert max((stepped[n] != bf16[n]).float().mean().item() for n in bf16) < 0.05  # why: bf16 drops the step


def test_frozen_teacher_keeps_the_initial_weights(tmp_path, tiny_model_dir):
    run = build_run(_config(tmp_path, tiny_model_dir, "teacher.kind=frozen", "run.name=frozen"))
    run.run_dir.mkdir(parents=True)
    frozen = {n: p.detach().clone() for n, p in run.teacher.engine.model.named_parameters()}
    train_step(run)
    assert run.teacher.engine is not run.student_engine
    for name, param in run.teacher.engine.model.named_parameters():
        assert torch.equal(param, frozen[name]), name
    assert not torch.equal(run.model.get_parameter("model.norm.weight"), frozen["model.norm.weight"])


def test_bfloat16_frozen_teacher_computes_like_the_student(tmp_path, tiny_model_dir):
    """A frozen copy in bf16 weights would differ from the student's fp32-master autocast
    forward; held in the student's precision it passes the start check at fp32 tolerance."""
    run = build_run(_config(tmp_path, tiny_model_dir, "teacher.kind=frozen", "model.dtype=bfloat16",
                            "probe.tolerance=1e-6", "run.name=frozen_bf16"))
    assert next(run.teacher.engine.model.parameters()).dtype == torch.float32
    teacher = run.teacher.engine.score([run.probe])[0].logprobs  # each engine in the run's precision
    student = run.student_engine.score([run.probe])[0].logprobs
    assert torch.equal(teacher, student)


DIVERGENCES = ("topk_reverse_kl", "reverse_kl", "forward_kl", "jsd")


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_exact_divergences_vanish_for_a_teacher_equal_to_the_student(tmp_path, tiny_model_dir, divergence):
    """Self teacher, empty context: the two distributions are the same at every position, so
    every divergence and its gradient are 0 (pure OPD): exactly for the two KLs, whose
    student and teacher terms are the same arithmetic; up to rounding for JSD (log of a
    mixture) and top-k (the engine's top-k and the float64 tail are computed apart)."""
    run = build_run(_config(tmp_path, tiny_model_dir, "teacher.template=teacher/empty", "loss.lambda_rl=0",
                            f"loss.divergence={divergence}", "loss.top_k=5", "run.name=zero"))
    metrics = train_step(run)
    assert abs(metrics[f"loss/{divergence}"]) < 1e-6
    assert metrics["optim/grad_norm"] < 1e-5
    if divergence in ("reverse_kl", "forward_kl"):
        assert metrics[f"loss/{divergence}"] == 0.0 and metrics["optim/grad_norm"] == 0.0


def test_topk_divergence_is_at_most_the_full_one_on_the_same_rollouts(tmp_path, tiny_model_dir):
    """Same seed, same first step, so the same rollouts: lumping the tail into one bucket can
    only lose information (KL over K+1 buckets <= full KL), and the sampled estimate of the
    same reverse KL is identical in both runs. A frozen teacher that differs: none is 0."""
    values = {}
    for divergence in ("topk_reverse_kl", "reverse_kl", "forward_kl", "jsd"):
        run = build_run(_config(tmp_path, tiny_model_dir, "teacher.template=teacher/answer_note", "loss.lambda_rl=1",
                                f"loss.divergence={divergence}", "loss.top_k=20", f"run.name={divergence}"))
        values[divergence] = train_step(run)
    full, topk = values["reverse_kl"]["loss/reverse_kl"], values["topk_reverse_kl"]["loss/topk_reverse_kl"]
    assert 0 < topk <= full + 1e-6
    assert values["reverse_kl"]["opd/reverse_kl"] == values["topk_reverse_kl"]["opd/reverse_kl"]
    assert values["forward_kl"]["loss/forward_kl"] > 0 and 0 < values["jsd"]["loss/jsd"] < 0.5 * max(
        full, values["forward_kl"]["loss/forward_kl"])


@pytest.mark.parametrize("divergence", ["sampled", "reverse_kl"])
def test_token_clip_is_logged_and_bounds_the_opd_advantage(tmp_path, tiny_model_dir, divergence):
    """A frozen teacher with the answer in its prompt disagrees with the (tiny, nearly
    uniform) student by more than 1e-5 nats on some tokens: those are clipped (sampled: the
    saved advantage stays within [-c, c]; a divergence: positions above c are counted)."""
    run = build_run(_config(tmp_path, tiny_model_dir, "teacher.kind=frozen", "loss.token_clip=1e-5",
                            f"loss.divergence={divergence}", f"run.name=clip-{divergence}"))
    run.run_dir.mkdir(parents=True)
    metrics = train_step(run)
    assert 0 < metrics["opd/clipped_share"] <= 1
    if divergence == "sampled":
        advantages = [a for line in (run.folder.rollouts_file(1)).read_text().splitlines()
                      for a in json.loads(line)["advantage"]]
        assert max(abs(a) for a in advantages) <= 1e-5 + 1e-9


def test_a_per_entry_clip_trains_a_step_and_logs_the_unclipped_divergence(tmp_path, tiny_model_dir):
    """loss.clip_per = 'vocabulary_entry' (OPSD's clip) through a real step: a frozen answer-note teacher and
    the tiny student disagree on many of the 49k entries of each position, so positions are clipped; the
    logged loss/forward_kl stays the divergence itself, and the trained loss (capped terms) is below it."""
    run = build_run(_config(tmp_path, tiny_model_dir, "teacher.kind=frozen", "loss.divergence=forward_kl",
                            "loss.token_clip=1e-6", "loss.clip_per=vocabulary_entry", "run.name=entry-clip"))
    run.run_dir.mkdir(parents=True)
    metrics = train_step(run)
    assert 0 < metrics["opd/clipped_share"] <= 1
    assert metrics["loss/forward_kl"] > 0 and metrics["loss/pg"] < metrics["loss/forward_kl"]
    assert math.isfinite(metrics["optim/grad_norm"]) and metrics["optim/grad_norm"] > 0


def test_a_raw_reward_pushes_down_every_token_of_wrong_rollouts_in_a_run(tmp_path, tiny_model_dir):
    """loss.rl_advantage = 'raw' with loss.wrong_reward = -1 (the Modal OPD tutorial's GRPO term) through a
    real step: the tiny student answers nothing right, so every saved token's advantage is -1 (the default
    gives these all-wrong groups 0), while the saved reward stays the verifier's 0."""
    grpo = ("loss.lambda_opd=0", "loss.lambda_rl=1", "teacher.kind=none")
    for name, extra, expected in (("raw", ("loss.rl_advantage=raw", "loss.wrong_reward=-1"), -1.0), ("norm", (), 0.0)):
        run = build_run(_config(tmp_path, tiny_model_dir, *grpo, *extra, f"run.name={name}"))
        run.run_dir.mkdir(parents=True)
        metrics = train_step(run)
        records = [json.loads(line) for line in run.folder.rollouts_file(1).read_text().splitlines()]
        assert metrics["reward/accuracy"] == 0 and {r["reward"] for r in records} == {0.0}
        assert {a for r in records for a in r["advantage"]} == {expected}


def test_no_teacher_is_grpo_alone_without_a_teacher_forward(tmp_path, tiny_model_dir, monkeypatch):
    """teacher.kind = 'none': the metrics (less the teacher's opd/ ones) and weights of a `self` teacher
    run with loss.lambda_opd = 0, step for step, and no engine is ever asked to score."""
    grpo = ("run.steps=2", "loss.lambda_opd=0", "loss.lambda_rl=1", "run.checkpoint_every=2")
    scored = train(_config(tmp_path, tiny_model_dir, "run.name=scored", *grpo))

    def refuse(*args, **kwargs):
        raise AssertionError("a run without a teacher asked an engine to score")

    monkeypatch.setattr(LocalEngine, "score", refuse)
    monkeypatch.setattr(LocalEngine, "completion_states", refuse)
    alone = train(_config(tmp_path, tiny_model_dir, "run.name=alone", "teacher.kind=none", *grpo))
    without_opd = [{k: v for k, v in untimed(line).items() if not k.startswith("opd/")} for line in _lines(scored)]
    assert [untimed(line) for line in _lines(alone)] == without_opd
    assert not any(key.startswith("opd/") for line in _lines(alone) for key in line)
    weights = [load_model(run / "checkpoints" / "step_00002", "float32")[0].state_dict() for run in (scored, alone)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    from selfopd.config import ConfigError
    from selfopd.diagnostics.report import measure_run
    from selfopd.run.rollouts import DiagnosticsError

    with pytest.raises(DiagnosticsError, match="no teacher signal to diagnose"):
        measure_run(alone, with_model=False, progress=False)
    with pytest.raises(ConfigError, match=r"^loss.lambda_opd: asks for a teacher, and teacher.kind is 'none'"):
        load_config(None, ["teacher.kind=none"])


def test_full_vocabulary_divergence_with_vllm_is_refused():
    from selfopd.config import ConfigError

    with pytest.raises(ConfigError, match="loss.divergence: 'jsd' needs the teacher's full distribution"):
        load_config(None, ["loss.divergence=jsd", "engine.kind=vllm"])


def test_tempered_sampling_with_vllm_is_refused():
    """vLLM scores from raw logits only: a tempered policy could not be scored by its teacher."""
    from selfopd.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.temperature: must be 1 with engine.kind = 'vllm', got 0.7"):
        load_config(None, ["rollout.temperature=0.7", "engine.kind=vllm"])


def test_an_sft_teacher_that_trained_on_the_runs_held_out_prompts_is_refused(tmp_path, tiny_model_dir):
    """Wherever the teacher was made: its model folder records its training prompts, and a run
    refuses it before any model loads when they include the run's held-out prompts."""
    import shutil

    from selfopd.config import ConfigError
    from selfopd.data.example import prompt_key
    from selfopd.core.models import MARKER
    from selfopd.data.split import load_split

    config = _config(tmp_path, tiny_model_dir, "run.name=leaky-teacher")
    train, held_out = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, teacher)
    trained = [prompt_key(e.prompt) for e in train[:5] + held_out[:2]]  # two held-out prompts leaked
    (teacher / MARKER).write_text(json.dumps({"settings": {}, "summary": {}, "trained_prompts": trained}))
    external = ["teacher.kind=external", f"teacher.model={teacher}"]
    with pytest.raises(ConfigError, match=r"teacher.model: .* was fine-tuned \(selfopd sft\) on 2 of this run's 4 "
                                          r"held-out prompts"):
        build_run(_config(tmp_path, tiny_model_dir, "run.name=leaky-teacher", *external))
    # Trained on training prompts only: accepted.
    (teacher / MARKER).write_text(json.dumps({"settings": {}, "summary": {}, "trained_prompts": trained[:5]}))
    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=clean-teacher", *external))
    run.close()


def test_a_teacher_row_past_the_teacher_context_stops_the_step_naming_it(tmp_path, tiny_model_dir):
    """What the start check cannot see (a server's context, a verdict's length): every teacher
    row of a step is measured against the teacher engine's context before it is scored."""
    from selfopd.config import ConfigError

    run = build_run(_config(tmp_path, tiny_model_dir, "run.name=long_teacher"))
    run.model.config.max_position_embeddings = 40  # the self teacher's engine reads it now
    with pytest.raises(ConfigError, match=r"teacher.template: step 1, data row 'chain_sum/seed2/\d+': the teacher's "
                       r"prompt \(\d+ tokens\) plus the student's completion \(\d+ tokens\) exceeds the teacher's "
                       r"context of 40 tokens"):
        train_step(run)
    assert run.step == 0


def test_a_resume_by_train_itself_refuses_links_before_anything_runs(tmp_path, tiny_model_dir):
    """`selfopd compare` resumes its arms through train(resume=True), not load_run_config: the link check
    runs there too, before a checkpoint is chosen or pruned."""
    from selfopd.core.run_folder import CheckpointError, RunFolder

    config = _config(tmp_path, tiny_model_dir)
    run = RunFolder.of(config.run.out_dir, config.run.name)
    (tmp_path / "elsewhere" / "step_00001").mkdir(parents=True)
    run.root.mkdir(parents=True)
    run.checkpoints.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"checkpoints: a link \(to .*elsewhere\), which selfopd does not follow"):
        train(config, resume=True)
    assert (tmp_path / "elsewhere" / "step_00001").is_dir() and sorted(p.name for p in run.root.iterdir()) == ["checkpoints"]


def test_no_held_out_prompts_with_a_test_set_of_its_own(tmp_path, tiny_model_dir):
    """data.eval_size = 0 with eval.data (the Modal tutorial trains on rows 0-99 and evaluates rows 100-119): every
    example of data.spec trains, the in-run eval scores eval.data; without eval.data it is refused."""
    from selfopd.config import ConfigError
    from selfopd.data.split import SplitRecord

    test_set = "rg:products?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=3&seed=5"
    config = _config(tmp_path, tiny_model_dir, "data.eval_size=0", f"eval.data={test_set}", "run.steps=1",
                     "run.eval_every=0")
    run_dir = train(config)
    record = SplitRecord.read(run_dir)
    assert record.eval_prompts == [] and len(set(record.train_prompts)) == 60
    evals = [line for line in _lines(run_dir) if "eval/accuracy" in line]
    assert len(evals) == 2 and all(line["eval/n"] == 3 for line in evals), evals
    with pytest.raises(ConfigError, match=r"data\.eval_size: 0 holds nothing out of data\.spec, so the in-run eval "
                                          r"needs eval\.data"):
        _config(tmp_path, tiny_model_dir, "data.eval_size=0")
