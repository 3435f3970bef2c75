"""What every vLLM-backed engine must do with sampled ids, checked the same way for the
server engine (tests/serving/test_vllm.py) and the colocated one (tests/serving/test_colocate.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from selfopd.engines.base import SamplingParams

TOLERANCE = 1e-4  # fp32 on both sides
ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 3 + 4?", "Name a prime number larger than 10.", "Say hello in French."]


def chat_prompts(tokenizer, questions):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    return [p if isinstance(p, list) else p["input_ids"] for p in prompts]


def hf_logprobs(model, prompt, completion):
    """Plain full-sequence forward: the reference for any engine."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def check_rollouts(engine, model, tokenizer):
    """Exact ids, eos handling, n distinct samples, seeded repeats, and sampler logprobs equal
    to the raw model's (temperature 1, no top-p); returns (prompts, params, groups)."""
    prompts = chat_prompts(tokenizer, QUESTIONS)
    params = SamplingParams(max_tokens=24, temperature=1.0, n=2, seed=7)
    groups = engine.sample(prompts, params)
    assert [len(g) for g in groups] == [2, 2, 2]
    eos = tokenizer.eos_token_id
    for prompt, group in zip(prompts, groups):
        assert group[0].completion_ids != group[1].completion_ids  # n samples differ
        for rollout in group:
            assert rollout.prompt_ids == prompt
            assert rollout.text == tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
            if rollout.finish_reason == "stop":
                assert rollout.completion_ids[-1] == eos and eos not in rollout.completion_ids[:-1]
            else:
                assert len(rollout.completion_ids) == params.max_tokens and eos not in rollout.completion_ids
            reference = hf_logprobs(model, prompt, rollout.completion_ids)
            assert torch.allclose(torch.tensor(rollout.sampler_logprobs, dtype=torch.float64), reference, atol=TOLERANCE)
    again = engine.sample(prompts, params)
    assert [[r.completion_ids for r in g] for g in again] == [[r.completion_ids for r in g] for g in groups]
    return prompts, params, groups


def check_scoring(sampler, scorer, model, tokenizer):
    """`scorer` gives the in-process engine's logprobs and top-k (ids wherever neighbours are
    not within rounding of each other) on rollouts of `sampler`; returns the sequences."""
    from selfopd.engines.local import LocalEngine

    prompts = chat_prompts(tokenizer, QUESTIONS)
    rollouts = [r for g in sampler.sample(prompts, SamplingParams(max_tokens=20, n=2, seed=3)) for r in g]
    sequences = [(r.prompt_ids, r.completion_ids) for r in rollouts]
    local = LocalEngine(model, tokenizer).score(sequences, top_k=5)
    for top_k in (0, 5):
        served = scorer.score(sequences, top_k=top_k)
        for mine, theirs, (_, completion) in zip(local, served, sequences):
            assert theirs.logprobs.shape == (len(completion),)
            assert (theirs.logprobs - mine.logprobs).abs().max().item() <= TOLERANCE
            if top_k:
                assert (theirs.topk_logprobs - mine.topk_logprobs).abs().max().item() <= TOLERANCE
                distinct = (mine.topk_logprobs[:, :-1] - mine.topk_logprobs[:, 1:]).abs() > 1e-3
                assert torch.equal(theirs.topk_ids[:, 0], mine.topk_ids[:, 0])
                assert torch.equal(theirs.topk_ids[:, :-1][distinct], mine.topk_ids[:, :-1][distinct])
            else:
                assert theirs.topk_ids is None
    return sequences


def check_tempered_logprobs(engine, model, tokenizer):
    """Sampler logprobs are those of the tempered distribution the token was drawn from (what
    the trainer's importance ratio needs), not the raw model's, which differ by far more."""
    from selfopd.engines.local import LocalEngine

    prompts = chat_prompts(tokenizer, QUESTIONS)
    local = LocalEngine(model, tokenizer)
    rollouts = [r for g in engine.sample(prompts, SamplingParams(max_tokens=12, temperature=0.6, n=2, seed=9)) for r in g]
    pairs = [(r.prompt_ids, r.completion_ids) for r in rollouts]
    worst_raw = 0.0
    for rollout, tempered, raw in zip(rollouts, local.score(pairs, temperature=0.6), local.score(pairs)):
        sampler = torch.tensor(rollout.sampler_logprobs)
        assert (sampler - tempered.logprobs).abs().max().item() <= TOLERANCE
        worst_raw = max(worst_raw, (sampler - raw.logprobs).abs().max().item())
    assert worst_raw > 0.01


def train_demo_steps(tmp_path, name, settings, steps: int = 2, launcher=("-m", "selfopd"),
                     probe=("probe/max_abs_diff", TOLERANCE)):
    """`selfopd train experiments/demo/demo.toml` cut to `steps` short steps with `settings` (`--set`
    values), in a subprocess (`launcher`: another module such as torch.distributed.run);
    checks it ran every step with every probe within `probe` (its metric, its bound: fp32's
    max gap by default); returns the step metrics."""
    import subprocess

    result = subprocess.run(demo_command(tmp_path, name, settings, steps, launcher), capture_output=True, text=True,
                            timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    return checked_demo_run(tmp_path, name, steps, probe)


def demo_command(tmp_path, name, settings, steps: int = 2, launcher=("-m", "selfopd")) -> list[str]:
    """The command line of `train_demo_steps`."""
    import sys

    short = [f"run.out_dir={tmp_path}", f"run.name={name}", f"run.steps={steps}", "run.progress=false",
             "data.eval_size=8", "rollout.prompts_per_step=2", "optim.micro_batch_prompts=2", "rollout.max_tokens=16",
             "rollout.temperature=1.0"]
    return [sys.executable, *launcher, "train", str(ROOT / "experiments/demo/demo.toml"),
            *[f"--set={item}" for item in [*short, *settings]]]


def checked_demo_run(tmp_path, name, steps: int = 2, probe=("probe/max_abs_diff", TOLERANCE)):
    """`train_demo_steps`' checks of a finished run; its step metrics."""
    import json

    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss/pg" in m]
    assert [m["step"] for m in trained] == list(range(1, steps + 1))
    gaps = [(m["step"], m[probe[0]], m["time/sample"]) for m in trained]
    assert all(gap <= probe[1] and sampled > 0 for _, gap, sampled in gaps), \
        f"(step, {probe[0]}, time/sample) {gaps}: a gap past {probe[1]} or no sampling time"
    assert (tmp_path / name / "checkpoints" / f"step_{steps:05d}" / "trainer_state.pt").exists()
    return trained
