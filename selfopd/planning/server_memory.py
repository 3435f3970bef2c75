"""What a vLLM server selfopd launches holds on each of its GPUs, for the memory plan
(`selfopd.planning.memory_fit`): its weights over its tensor-parallel GPUs, the KV cache of the
sequences it holds at once in each phase (rollouts, the teacher's scoring, the in-run eval),
and, on a teacher server, the `prompt_logprobs` spike vLLM allocates beyond its share.

Sequences at once: the trainer sends at most engine.max_concurrency requests per rank, spread
round-robin over the servers of a role; a sampling request of n samples holds n sequences, a
scoring request one (`selfopd.serving.vllm`).

The spike (vLLM 0.32, `GPUModelRunner._get_prompt_logprobs_dict`): a scoring request's prompt
is prompt + completion, and vLLM forms, one request at a time, the logits of every prompt
position it scheduled in a step (model dtype), their float32 copy and float32 log-softmax
(`Sampler.compute_logprobs`), while the previous request's float32 log-probabilities are still
referenced. A step schedules at most max_num_batched_tokens positions. vLLM's profiling at
start-up does not run this, so it is not inside engine.gpu_memory_utilization: a server takes
its share whole (the KV cache fills it) and the spike on top.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from selfopd.planning.memory_plan import GIB, ModelShape, Part, Process, _count, gib

LOGPROB_COPY_BYTES = 8  # per position and vocabulary entry beyond the logits: their fp32 copy and fp32 log-softmax
PREVIOUS_LOGPROB_BYTES = 4  # the previous request's fp32 log-softmax, still referenced


@dataclass(frozen=True)
class Load:
    """Sequences a server holds at once in one phase: `requests` of `per_request` sequences each, at most
    `concurrency` per trainer rank of `world`, spread over `servers`; each up to `length` tokens."""

    requests: int
    per_request: int
    concurrency: int
    world: int
    servers: int
    length: int
    vocab: int = 0  # a scoring load's: the teacher's vocabulary, and its dtype's bytes (the prompt_logprobs spike)
    dtype_bytes: int = 2

    @property
    def sequences(self) -> int:
        return math.ceil(min(self.requests, self.world * self.concurrency) / self.servers) * self.per_request

    def requests_fitting(self, sequences: int) -> int:
        """The most requests in flight over all servers that keep each server at `sequences` or fewer."""
        return (sequences // self.per_request) * self.servers


def batched_token_budget(extra_server_args: str, capacity: float | None, gpu_name: str) -> tuple[int, int, str]:
    """(max_num_batched_tokens, max_num_seqs, why) of a launched GPU server: engine.extra_server_args' flags,
    else vLLM 0.32's `vllm serve` defaults (EngineArgs.get_batch_defaults) for a GPU of `capacity` bytes
    (None: an H100's)."""
    words = shlex.split(extra_server_args)
    given = {}
    for index, word in enumerate(words):
        flag, _, value = word.partition("=")
        flag = flag.replace("_", "-")
        if flag in ("--max-num-batched-tokens", "--max-num-seqs"):
            value = value or (words[index + 1] if index + 1 < len(words) else "")
            if value.isdigit():
                given[flag] = int(value)
    memory = 80 * GIB if capacity is None else capacity
    if memory >= 160 * GIB:
        tokens, seqs, where = 16384, 1024, "vLLM's default on a GPU of 160 GiB or more"
    elif memory >= 70 * GIB and "a100" not in gpu_name.lower():
        tokens, seqs, where = 8192, 1024, "vLLM's default on a GPU of 70 GiB or more"
    else:
        tokens, seqs, where = 2048, 256, "vLLM's default on a GPU under 70 GiB or an A100"
    if "--max-num-batched-tokens" in given:
        tokens, where = given["--max-num-batched-tokens"], "--max-num-batched-tokens in engine.extra_server_args"
    return tokens, given.get("--max-num-seqs", seqs), where


def prompt_logprobs_bytes(vocab: int, dtype_bytes: int, length: int, sequences: int, batched_tokens: int) -> float:
    """Bytes of the prompt_logprobs spike: one request's scheduled positions (its prompt + completion, at most a
    step's token budget) as logits and two fp32 copies, plus the previous request's fp32 log-probabilities."""
    current = min(length, batched_tokens)
    previous = min(length, batched_tokens - current) if sequences > 1 else 0
    return vocab * (current * (dtype_bytes + LOGPROB_COPY_BYTES) + previous * PREVIOUS_LOGPROB_BYTES)


def spike_bytes(load: Load, batched_tokens: int) -> float:
    return prompt_logprobs_bytes(load.vocab, load.dtype_bytes, load.length, load.sequences, batched_tokens)


def prompt_logprobs_part(load: Load, batched_tokens: int, why: str) -> Part:
    spike = spike_bytes(load, batched_tokens)
    return Part("prompt_logprobs", spike, f"{_count(min(load.length, batched_tokens))} positions x {_count(load.vocab)} "
                f"vocab: logits + 2 fp32 copies, one request at a time (max_num_batched_tokens {batched_tokens}: {why}); "
                "beyond its share")


def kv_bytes(shape: ModelShape, dtype_bytes: int, tp: int, load: Load) -> float:
    """The KV cache of `load`'s sequences on one of `tp` GPUs: keys and values per token, the Gated DeltaNet state
    per sequence."""
    return load.sequences * (load.length * shape.kv_bytes_per_token(dtype_bytes, tp)
                             + shape.state_bytes_per_sequence(dtype_bytes, tp))


def server_process(shape: ModelShape, name: str, gpus: tuple[int, ...], tp: int, dtype: str, loads: dict[str, Load],
                   budget: float | None, budget_how: str) -> Process:
    """A vLLM server, per GPU: its weights over its `tp` GPUs, and a phase per load (its KV cache)."""
    dtype_bytes = 2 if dtype == "bfloat16" else 4
    proc = Process(name, gpus, budget=budget, budget_how=budget_how)
    proc.held.append(Part("weights", shape.params * dtype_bytes / tp, f"{dtype}" + (f", 1/{tp} (TP)" if tp > 1 else "")))
    layout = f"{shape.attention_layers} attention layers x {max(1, shape.kv_heads // tp)} KV heads x {shape.head_dim}"
    if shape.linear_layers:
        layout += f", {shape.linear_layers} Gated DeltaNet layers' state"
    for phase, load in loads.items():
        proc.phases[phase] = [Part("KV cache", kv_bytes(shape, dtype_bytes, tp, load),
                                   f"{load.sequences} sequences x {load.length} tokens; {layout}")]
    proc.loads = dict(loads)
    return proc


# The setting that lowers each phase's sequences at once.
PHASE_KEYS = {"serve": "engine.max_concurrency", "score": "engine.max_concurrency", "eval": "eval.batch_size"}


def server_refusal(proc: Process, gpu_name: str) -> str:
    """One line for a server whose weights and KV cache exceed its share: the setting that fits it."""
    phase = proc.peak_phase
    load = proc.loads[phase]
    weights = sum(p.bytes for p in proc.held)
    kv = proc.peak - weights
    per_sequence = kv / load.sequences
    fitting = int(max((proc.budget or 0) - weights, 0) // per_sequence)
    requests = load.requests_fitting(fitting)
    what = {"serve": "rollout", "score": "scored", "eval": "in-run eval"}[phase]
    key = PHASE_KEYS[phase]
    value = requests // load.world if key == "engine.max_concurrency" else requests
    if value >= 1:
        fix = f"lower {key} to {value} or less"
    elif phase == "eval":
        fix = "lower eval.samples or eval.max_tokens (not one eval prompt fits)"
    else:
        fix = "lower rollout.samples_per_prompt or rollout.max_tokens (not one request fits)"
    return (f"the memory plan does not fit: the {proc.name} on GPU {', '.join(map(str, proc.gpus))} ({gpu_name}) "
            f"needs {gib(proc.peak)} (weights {gib(weights)}, KV cache {gib(kv)} for {load.sequences} "
            f"{what} sequences of up to {load.length} tokens), {gib(proc.peak - (proc.budget or 0))} more than its "
            f"share {gib(proc.budget or 0)} ({proc.budget_how}); {fix}, raise engine.gpu_memory_utilization, or "
            "raise engine.tensor_parallel_size")

