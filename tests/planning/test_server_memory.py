"""A launched vLLM server's memory for the plan: sequences at once per phase, and the teacher's
prompt_logprobs spike, against vLLM's own defaults and a hand count of the tensors vLLM forms."""

from __future__ import annotations

import pytest

from selfopd.planning.memory_plan import GIB
from selfopd.planning.server_memory import Load, batched_token_budget, prompt_logprobs_bytes


def test_sequences_are_requests_in_flight_spread_over_the_servers_times_samples():
    # 32 prompts of 4 samples, 64 requests a rank, 6 student servers: 6 prompts (ceil 32 / 6) x 4 on the busiest
    assert Load(32, 4, 64, 1, 6, 1280).sequences == 24
    # 1024 prompts, 10 requests a rank, 2 ranks, one server: 20 requests in flight
    assert Load(1024, 4, 10, 2, 1, 100).sequences == 80
    # 41 sequences a server fit: 10 requests of 4 on each of 3 servers, 15 a rank of 2; 16 a rank would not
    assert Load(1024, 4, 64, 2, 3, 100).requests_fitting(41) == 30
    assert Load(1024, 4, 15, 2, 3, 100).sequences == 40 and Load(1024, 4, 16, 2, 3, 100).sequences == 44


def test_the_spike_is_one_requests_logits_two_fp32_copies_and_the_previous_log_probabilities():
    """vLLM 0.32 `_get_prompt_logprobs_dict`: per request, logits (model dtype) -> log_softmax(dtype=float32)
    (an fp32 copy, then the fp32 result); the previous request's result is still bound while the next forms."""
    vocab, length = 151936, 4352
    one = length * vocab * (2 + 4 + 4)
    assert prompt_logprobs_bytes(vocab, 2, length, 1, 8192) == one
    assert prompt_logprobs_bytes(vocab, 2, length, 32, 8192) == one + (8192 - length) * vocab * 4
    assert prompt_logprobs_bytes(vocab, 2, 20000, 32, 8192) == 8192 * vocab * 10  # a step schedules 8192 at most
    # vLLM PR #52054's case, 8192 positions of a 152k vocabulary: about 7.5 GiB of logits and log-softmax alone
    assert 8192 * 152_000 * (2 + 4) / GIB == pytest.approx(7.0, abs=0.1)


def test_batched_token_budget_is_vllms_own_default_or_the_flag_given(monkeypatch):
    """The defaults table equals vLLM's EngineArgs.get_batch_defaults for `vllm serve` on each kind of GPU."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    for gib, name in ((80, "NVIDIA H100 80GB HBM3"), (141, "NVIDIA H200"), (80, "NVIDIA A100-SXM4-80GB"),
                      (48, "NVIDIA L40S"), (180, "NVIDIA B200")):
        monkeypatch.setattr(type(current_platform), "get_device_total_memory", classmethod(lambda cls, *a: gib * GIB))
        monkeypatch.setattr(type(current_platform), "get_device_name", classmethod(lambda cls, *a: name))
        monkeypatch.setattr(type(current_platform), "is_cpu", classmethod(lambda cls: False))
        tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
        ours = batched_token_budget("", gib * GIB, name)
        assert ours[:2] == (tokens[UsageContext.OPENAI_API_SERVER], seqs[UsageContext.OPENAI_API_SERVER]), name
    assert batched_token_budget("--max-num-batched-tokens 4096 --max-num-seqs=64", 80 * GIB, "H100")[:2] == (4096, 64)
    assert batched_token_budget("--max_num_batched_tokens=2048", 80 * GIB, "H100")[0] == 2048
