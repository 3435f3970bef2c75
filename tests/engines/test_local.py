"""The in-process engine on the real packaged model: exact ids, consistent logprobs."""

from __future__ import annotations

import copy

import pytest
import torch

from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.templating.templates import prompt_token_ids

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 3 + 4?", "Name a colour.", "Count from one to five."]


@pytest.fixture(scope="module")
def engine(smollm2_model, smollm2_tokenizer):
    return LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=8, chunk_size=7)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [prompt_token_ids(smollm2_tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def rollouts(engine, prompts):
    return engine.sample(prompts, SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=0))


def test_sample_shape_and_exact_ids(rollouts, prompts, smollm2_tokenizer):
    assert [len(group) for group in rollouts] == [2, 2, 2]
    eos = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt, group in zip(prompts, rollouts):
        for rollout in group:
            assert rollout.prompt_ids == prompt
            assert 1 <= len(rollout.completion_ids) <= 12
            assert len(rollout.sampler_logprobs) == len(rollout.completion_ids)
            if rollout.finish_reason == "stop":
                assert rollout.completion_ids[-1] == eos and eos not in rollout.completion_ids[:-1]
            else:
                assert len(rollout.completion_ids) == 12 and eos not in rollout.completion_ids
            assert rollout.text == smollm2_tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)


def test_sampler_logprobs_equal_scoring_logprobs(engine, rollouts):
    """Left-padded KV-cache decoding and right-padded scoring must agree: the trainer's
    importance ratio relies on it."""
    flat = [r for group in rollouts for r in group]
    scores = engine.score([(r.prompt_ids, r.completion_ids) for r in flat])
    for rollout, score in zip(flat, scores):
        assert score.logprobs.shape == (len(rollout.completion_ids),)
        torch.testing.assert_close(score.logprobs, torch.tensor(rollout.sampler_logprobs), atol=2e-4, rtol=0)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampler_logprobs_are_those_of_the_tempered_distribution(engine, prompts, temperature):
    """At temperature T the sampler reports log softmax(logits / T) of the drawn token, which
    scoring at T reproduces (the trainer's importance ratio is then 1) and raw scoring does not."""
    groups = engine.sample(prompts, SamplingParams(max_tokens=10, temperature=temperature, n=2, seed=3))
    flat = [r for group in groups for r in group]
    pairs = [(r.prompt_ids, r.completion_ids) for r in flat]
    tempered, raw = engine.score(pairs, temperature=temperature), engine.score(pairs)
    worst_raw = 0.0
    for rollout, at_t, at_1 in zip(flat, tempered, raw):
        sampler = torch.tensor(rollout.sampler_logprobs)
        torch.testing.assert_close(at_t.logprobs, sampler, atol=2e-4, rtol=0)
        worst_raw = max(worst_raw, (at_1.logprobs - sampler).abs().max().item())
    assert worst_raw > 0.01  # so the check above can tell a tempered from a raw sampler


def test_top_p_sampler_logprobs_are_renormalised_over_the_nucleus(engine, prompts):
    """With top_p < 1 the sampler's distribution is the nucleus: each drawn token is at least
    as likely there as under the full tempered distribution, and strictly more somewhere."""
    groups = engine.sample(prompts, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.5, n=2, seed=4))
    flat = [r for group in groups for r in group]
    scores = engine.score([(r.prompt_ids, r.completion_ids) for r in flat])
    gaps = torch.cat([torch.tensor(r.sampler_logprobs) - s.logprobs for r, s in zip(flat, scores)])
    assert gaps.min() > -2e-4 and gaps.max() > 0.05


def test_scores_equal_float64_reference_and_topk_is_consistent(engine, rollouts, smollm2_model):
    rollout = rollouts[0][0]
    (score,) = engine.score([(rollout.prompt_ids, rollout.completion_ids)], top_k=5)
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        reference_TV = smollm2_model(ids).logits[0].double().log_softmax(-1)
    start = len(rollout.prompt_ids)
    positions = torch.arange(start - 1, ids.shape[1] - 1)
    expected = reference_TV[positions, ids[0, start:]]
    torch.testing.assert_close(score.logprobs.double(), expected, atol=1e-4, rtol=0)
    expected_top = reference_TV[positions].topk(5, dim=-1)
    assert torch.equal(score.topk_ids, expected_top.indices)
    torch.testing.assert_close(score.topk_logprobs.double(), expected_top.values, atol=1e-4, rtol=0)
    assert torch.all(score.logprobs <= score.topk_logprobs[:, 0] + 1e-6)


def test_greedy_is_deterministic_and_seeded_sampling_repeats(engine, prompts):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first, second = engine.sample(prompts[:2], greedy), engine.sample(prompts[:2], greedy)
    assert [r[0].completion_ids for r in first] == [r[0].completion_ids for r in second]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    assert [r[0].completion_ids for r in engine.sample(prompts[:2], seeded)] == [
        r[0].completion_ids for r in engine.sample(prompts[:2], seeded)
    ]


def test_update_weights_copies_into_a_separate_model(smollm2_model, smollm2_tokenizer, prompts):
    clone = copy.deepcopy(smollm2_model)
    engine = LocalEngine(clone, smollm2_tokenizer)
    name = "model.norm.weight"
    new = {name: smollm2_model.get_parameter(name).detach() * 1.5}
    engine.update_weights(new, version=3)
    assert engine.version == 3
    assert torch.equal(clone.get_parameter(name), new[name])
    assert not torch.equal(clone.get_parameter(name), smollm2_model.get_parameter(name))
    with pytest.raises(KeyError, match="not in the engine's model"):
        engine.update_weights({"no.such.weight": torch.zeros(1)}, version=4)


def test_the_checkpoint_generation_config_does_not_shape_the_policy(smollm2_model, smollm2_tokenizer, prompts):
    """A checkpoint whose generation_config sets repetition_penalty, min_p, no_repeat_ngram_size,
    top_k and a temperature: the samples are still drawn from the tempered model alone (sampler
    logprob = scoring logprob, so the importance ratio is 1), and greedy decoding is its argmax."""
    model = copy.deepcopy(smollm2_model)
    model.generation_config.update(repetition_penalty=1.5, min_p=0.2, no_repeat_ngram_size=2, top_k=5,
                                   temperature=0.3, do_sample=True)
    engine = LocalEngine(model, smollm2_tokenizer, batch_size=8)
    groups = engine.sample(prompts, SamplingParams(max_tokens=16, temperature=0.8, n=2, seed=5))
    flat = [r for group in groups for r in group]
    scores = engine.score([(r.prompt_ids, r.completion_ids) for r in flat], temperature=0.8)
    gaps = torch.cat([torch.tensor(r.sampler_logprobs) - s.logprobs for r, s in zip(flat, scores)])
    assert gaps.abs().max() < 2e-4  # the checkpoint's processors moved them by nats
    greedy = [g[0] for g in engine.sample(prompts, SamplingParams(max_tokens=16, temperature=0.0))]
    best = engine.score([(r.prompt_ids, r.completion_ids) for r in greedy], top_k=1)
    for rollout, score in zip(greedy, best):
        assert score.topk_ids[:, 0].tolist() == rollout.completion_ids
    assert model.generation_config.repetition_penalty == 1.5  # given back as it was


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_packed_sampling_samples_the_same_policy_and_restores_the_model(smollm2_model, smollm2_tokenizer, prompts,
                                                                        temperature):
    """MKL's packed products (`selfopd.engines.packed`) change only the order of summation: the drawn
    tokens' logprobs are the trainer's (float64 scoring) within 1e-4, the seeded draws mostly the same
    tokens as plain sgemm, and every linear layer computes as before once sampling returns."""
    from selfopd.engines.packed import packed_linears

    params = SamplingParams(max_tokens=24, temperature=temperature, n=2, seed=3)
    plain = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=6).sample(prompts, params)
    packed = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=6, packed=True).sample(prompts, params)
    flat = [r for group in packed for r in group]
    reference = LocalEngine(smollm2_model, smollm2_tokenizer).score([(r.prompt_ids, r.completion_ids) for r in flat],
                                                                    temperature=temperature)
    for rollout, score in zip(flat, reference):
        torch.testing.assert_close(torch.tensor(rollout.sampler_logprobs), score.logprobs, atol=1e-4, rtol=0)
    same = sum(a.completion_ids == b.completion_ids for ga, gb in zip(plain, packed) for a, b in zip(ga, gb))
    assert same >= 4, f"only {same} of 6 seeded samples kept their tokens"
    linears = [m for m in smollm2_model.modules() if type(m) is torch.nn.Linear]
    assert all("forward" not in m.__dict__ for m in linears)
    x = torch.randn(2, 5, linears[0].in_features)
    with torch.no_grad(), packed_linears(smollm2_model, rows=2):
        assert "forward" in linears[0].__dict__
        torch.testing.assert_close(linears[0](x), torch.nn.functional.linear(x, linears[0].weight))  # prefill rows
        torch.testing.assert_close(linears[0](x[:, :1]), torch.nn.functional.linear(x[:, :1], linears[0].weight))
    assert all("forward" not in m.__dict__ for m in linears)


def test_packed_sampling_is_refused_where_it_cannot_run(tmp_path, tiny_model_dir):
    from selfopd.config import ConfigError, load_config
    from selfopd.training.trainer import build_run

    with pytest.raises(ConfigError, match=r"engine.packed_sampling: needs fp32 sampling on a CPU: model.dtype is 'bfloat16'"):
        build_run(load_config(None, [f"model.student={tiny_model_dir}", "model.dtype=bfloat16", "engine.packed_sampling=true",
                                     f"run.out_dir={tmp_path}", "data.spec=rg:chain_sum?size=20&seed=2", "data.eval_size=4"]))
    with pytest.raises(ConfigError, match=r"engine.packed_sampling: is for the in-process sampler"):
        load_config(None, ["engine.packed_sampling=true", "engine.kind=vllm", "rollout.temperature=1"])


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "qwen3_5_conditional"])
def test_each_family_samples_left_padded_batches_as_rows_alone(tiny_family_dirs, family, packed):
    """Prompts of different lengths share a left-padded batch: a padded row decodes as it does alone
    (Qwen3.5's Gated DeltaNet zeroes padded inputs, so its state starts at the first real token;
    unmasked padding would move the logprobs by ~0.2 here), and the sampler's logprobs are the scorer's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_family_dirs[family]
    engine = LocalEngine(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                         batch_size=8, packed=packed)
    prompts = [list(range(5, 8)), list(range(10, 30)), list(range(40, 49)), [100]]
    flat = [r for group in engine.sample(prompts, SamplingParams(max_tokens=8, n=2, seed=3)) for r in group]
    for rollout, score in zip(flat, engine.score([(r.prompt_ids, r.completion_ids) for r in flat])):
        torch.testing.assert_close(torch.tensor(rollout.sampler_logprobs), score.logprobs, atol=1e-5, rtol=0)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for batched, prompt in zip(engine.sample(prompts, greedy), prompts):
        alone = engine.sample([prompt], greedy)[0][0]
        assert batched[0].completion_ids == alone.completion_ids
        torch.testing.assert_close(torch.tensor(batched[0].sampler_logprobs), torch.tensor(alone.sampler_logprobs),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_compiled_decoding_samples_what_eager_decoding_samples(tiny_family_dirs, family):
    """A static KV cache and a compiled decode step change no draw: the same tokens and logprobs as
    generate's eager decoding, before and after the weights change in place (the compiled step takes
    them as inputs: an optimizer step reaches it), and a batch whose prompts are a few tokens longer
    reuses the compiled step (its prompts are padded to the same width)."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_family_dirs[family]
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eager = LocalEngine(model, tokenizer, batch_size=8)
    compiled = LocalEngine(model, tokenizer, batch_size=8, compiled=True, packed=family == "llama")
    params = SamplingParams(max_tokens=12, n=2, seed=5)
    first = [list(range(5, 8)), list(range(10, 30)), [100]]
    longer = [list(range(5, 12)), list(range(10, 33)), [100, 101]]

    def assert_same_draws(prompts: list[list[int]]) -> None:
        reference = [r for group in eager.sample(prompts, params) for r in group]
        drawn = [r for group in compiled.sample(prompts, params) for r in group]
        assert [r.completion_ids for r in drawn] == [r.completion_ids for r in reference]
        for a, b in zip(drawn, reference):
            torch.testing.assert_close(torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs),
                                       atol=1e-5, rtol=0)

    torch._dynamo.reset()
    assert_same_draws(first)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the decode step was compiled
    assert_same_draws(longer)
    with torch.no_grad():
        model.get_decoder().norm.weight.mul_(1.5)
    assert_same_draws(first)
    assert counters["stats"]["unique_graphs"] == graphs  # no second compilation


def test_compiled_sampling_is_refused_where_it_cannot_run(tiny_model_dir, smollm2_tokenizer):
    import contextlib

    from transformers import AutoModelForCausalLM

    from selfopd.config import ConfigError, load_config
    from selfopd.core.distributed import World
    from selfopd.training.engines import open_training_engines

    with pytest.raises(ConfigError, match=r"engine.compiled_sampling: is for the in-process sampler"):
        load_config(None, ["engine.compiled_sampling=true", "engine.kind=vllm", "rollout.temperature=1"])
    config = load_config(None, [f"model.student={tiny_model_dir}", "engine.compiled_sampling=true", "teacher.kind=self"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with contextlib.ExitStack() as resources, pytest.raises(ConfigError, match=r"compiled_sampling: is not supported "
                                                                                r"under torchrun"):
        open_training_engines(config, model, smollm2_tokenizer, tiny_model_dir, resources, World(rank=0, size=2))
    with contextlib.ExitStack() as resources:
        student, _ = open_training_engines(config, model, smollm2_tokenizer, tiny_model_dir, resources)
    assert student.compiled
