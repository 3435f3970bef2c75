"""selfopd.engines.scoring: prompt-shared completion logprobs equal a plain full-sequence computation,
in value and in gradient."""

from __future__ import annotations

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from transformers import LlamaConfig, LlamaForCausalLM

from selfopd.engines.scoring import completion_hidden, completion_logprobs, pad_completions, topk_from_hidden

# Shared prompts, a duplicate row, prompts of different lengths (left padding), ragged completions.
SEQUENCES = [
    ([5, 6, 7, 8, 9], [10, 11, 12]),
    ([5, 6, 7, 8, 9], [13, 14]),
    ([20, 21], [22, 23, 24, 25]),
    ([5, 6, 7, 8, 9], [10, 11, 12]),
    ([30, 31, 32], [33]),
]


@pytest.fixture
def float64_llama(monkeypatch):
    """A tiny random Llama in float64. Transformers' RMSNorm computes in float32 whatever the
    model dtype, which hides real gradient errors below float32 noise; computing it in the
    input dtype makes the comparison exact to float64 precision."""

    def rms_norm(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return LlamaForCausalLM(config).double().train()


def _reference(model, sequences):
    """Each sequence on its own, full forward, float64 log-softmax: the definition."""
    total = 0.0
    values = []
    for prompt, completion in sequences:
        logits_TV = model(torch.tensor([prompt + completion])).logits[0]
        logprobs_TV = logits_TV.log_softmax(-1)
        picked = logprobs_TV[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        values.append(picked)
        total = total + picked.sum()
    return values, total


# Every prompt once: nothing to share, so scoring takes one pass over prompt + completion.
DISTINCT = [([5, 6, 7, 8, 9], [10, 11, 12]), ([20, 21], [22, 23, 24, 25]), ([30, 31, 32], [33])]


@pytest.mark.parametrize("sequences", [SEQUENCES, DISTINCT], ids=["shared-prompts", "distinct-prompts"])
def test_values_and_gradients_equal_the_unshared_reference(float64_llama, sequences):
    model = float64_llama
    logprobs_BC, mask_BC = completion_logprobs(model, sequences, pad_id=0, chunk_size=2)
    (logprobs_BC * mask_BC).sum().backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    values, total = _reference(model, sequences)
    total.backward()
    assert mask_BC.tolist() == [[1] * len(c) + [0] * (mask_BC.shape[1] - len(c)) for _, c in sequences]
    for row, expected in enumerate(values):
        torch.testing.assert_close(logprobs_BC[row, : len(expected)], expected, atol=1e-12, rtol=0)
    assert torch.all(logprobs_BC[mask_BC == 0] == 0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(shared_grads[name], param.grad, atol=1e-9, rtol=1e-9, msg=name)


def test_topk_matches_reference(float64_llama):
    hidden_BCH, _, _ = completion_hidden(float64_llama, SEQUENCES, pad_id=0)
    ids_BCK, logprobs_BCK = topk_from_hidden(float64_llama, hidden_BCH, k=3, chunk_size=3)
    prompt, completion = SEQUENCES[2]
    with torch.no_grad():
        logprobs_TV = float64_llama(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
    expected = logprobs_TV[len(prompt) - 1 : -1].topk(3, dim=-1)
    assert torch.equal(ids_BCK[2], expected.indices)
    torch.testing.assert_close(logprobs_BCK[2].double(), expected.values, atol=1e-6, rtol=0)


def test_empty_prompt_or_completion_is_refused(float64_llama):
    with pytest.raises(ValueError, match="sequence 1 has an empty completion"):
        completion_logprobs(float64_llama, [([1, 2], [3]), ([1, 2], [])], pad_id=0)
    with pytest.raises(ValueError, match="sequence 0 has an empty prompt"):
        completion_logprobs(float64_llama, [([], [3])], pad_id=0)


def test_pad_completions():
    padded = pad_completions([[1.0, 2.0], torch.tensor([3.0])], 3)
    assert padded.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]] and padded.dtype == torch.float32


def test_heads_that_are_not_plain_are_refused(float64_llama, tmp_path, tiny_model_dir):
    """The kernels apply `hidden @ head.T` themselves and temper the hidden states: a head bias
    or a logit transform after the head (Granite's logits_scaling, Gemma's soft-capping) would
    silently be dropped, so such models are refused, by name, before anything is scored."""
    from transformers import AutoTokenizer, GraniteConfig, GraniteForCausalLM

    from selfopd.config import load_config
    from selfopd.core.models import ModelError
    from selfopd.training.setup import build_run
    from selfopd.engines.scoring import check_plain_head

    check_plain_head(float64_llama)  # plain: passes
    float64_llama.lm_head.bias = torch.nn.Parameter(torch.zeros(48, dtype=torch.float64))
    with pytest.raises(ModelError, match=r"LlamaForCausalLM has a bias on its output head: selfopd scores plain "
                       r"linear heads only"):
        completion_logprobs(float64_llama, SEQUENCES, pad_id=0)
    float64_llama.config.final_logit_softcapping = 30.0
    with pytest.raises(ModelError, match=r"and transforms its logits after the head \(config.final_logit_softcapping"):
        check_plain_head(float64_llama)

    granite = tmp_path / "granite"
    config = GraniteConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, logits_scaling=8.0)
    GraniteForCausalLM(config).save_pretrained(granite)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(granite)
    with pytest.raises(ModelError, match=rf"model.student {granite} \(GraniteForCausalLM\) transforms its logits "
                       r"after the head \(config.logits_scaling = 8.0\)"):
        build_run(load_config(None, [f"model.student={granite}", f"run.out_dir={tmp_path}", "data.eval_size=4",
                                     "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2"]))
    assert [p.name for p in tmp_path.iterdir()] == ["granite"]  # refused before a run folder is made


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "qwen3_5_conditional"])
def test_each_family_scores_as_each_sequence_alone(tiny_family_dirs, family):
    """The shared-prompt path where the family's cache allows it (Llama, Qwen3), the one-pass path
    where it does not (Qwen3.5's Gated DeltaNet): both equal each sequence scored alone, and each
    other, in value and gradient (fp32)."""
    from transformers import AutoModelForCausalLM

    from selfopd.engines.scoring import _hidden_in_one_pass, right_pad

    model = AutoModelForCausalLM.from_pretrained(tiny_family_dirs[family]).train()
    weights_H = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    gradients = []
    for path in ("completion_hidden", "one pass"):
        model.zero_grad()
        if path == "completion_hidden":
            hidden_BCH, _, mask_BC = completion_hidden(model, SEQUENCES, pad_id=2)
        else:
            ids_BC, mask_BC = right_pad([c for _, c in SEQUENCES], 2)
            hidden_BCH = _hidden_in_one_pass(model, SEQUENCES, ids_BC, mask_BC, pad_id=2)
        ((hidden_BCH @ weights_H) * mask_BC).sum().backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
        logprobs_BC, _ = completion_logprobs(model, SEQUENCES, pad_id=2)
        for row, expected in enumerate(_reference(model, SEQUENCES)[0]):
            torch.testing.assert_close(logprobs_BC[row, : len(expected)], expected, atol=2e-5, rtol=0)
    for name, shared in gradients[0].items():  # fp32 sums in another order: measured within 4e-7 of the largest
        scale = shared.abs().max().item()
        torch.testing.assert_close(shared, gradients[1][name], atol=1e-5 * scale, rtol=0, msg=name)


def test_a_cache_that_cannot_be_shared_is_said_once_per_process(tiny_family_dirs, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from selfopd.engines import scoring

    monkeypatch.setattr(scoring, "_UNSHARED", set())
    for family in ("llama", "qwen3_5", "qwen3_5_conditional"):
        model = AutoModelForCausalLM.from_pretrained(tiny_family_dirs[family])
        with torch.no_grad():
            completion_hidden(model, SEQUENCES, pad_id=2)
            completion_hidden(model, SEQUENCES, pad_id=2)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfopd:")]
    assert said == ["selfopd: scoring without a shared prompt cache (qwen3_5: its Gated DeltaNet layers keep a "
                    "recurrent state that transformers' cache cannot select per row): each sequence's prompt runs "
                    "through the model again, the same logprobs at more compute"]
