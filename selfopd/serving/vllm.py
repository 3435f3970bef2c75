"""The vLLM engine: the `Engine` interface over one or more vLLM servers.

Token ids in, token ids out, over the OpenAI-compatible `/v1/completions` route:

- `sample` sends the prompt as ids and asks for `return_token_ids` and the sampled
  tokens' logprobs, so the teacher later scores exactly the ids the student produced.
  Launched servers report the logprobs of the distribution sampled from (temperature
  and top-p applied: `--logprobs-mode processed_logprobs`), as the local engine does.
- `score` sends prompt + completion as ids with `max_tokens=1` and `prompt_logprobs=k`:
  vLLM returns, for every prompt position, the logprob of the actual token (and the top k),
  always from the raw logits: temperature 1 only.

Requests run concurrently (bounded) on an event loop in a background thread, so the
engine is a plain synchronous object, also inside Jupyter, whose own loop is busy. The
`openai` client retries connection errors, timeouts and 5xx answers with backoff; what
still fails, and any answer that is not what vLLM sends (broken JSON, a missing field, fewer
or more logprobs than tokens), becomes a `ServerError` naming the server's URL: never a
hang, never a silently shorter tensor.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Sequence, TypeVar

import httpx
import openai
import torch

from selfopd.engines.base import Rollout, SamplingParams, TokenScores, WeightSource
from selfopd.serving.liveness import request_timeout, watched
from selfopd.serving.server import ServerError, auth_headers, launched_key, unauthorized, vllm_version_problem
from selfopd.serving.weight_sync import WeightTransfer

T = TypeVar("T")
CLAMPED_LOGPROB = -9999.0  # vLLM's JSON stand-in for -inf


class VLLMEngine:
    """Samples and scores on vLLM servers; `update_weights` goes through a `WeightTransfer`.

    Several URLs serve the same model: prompts to sample are spread over them round-robin,
    sequences to score go each to the server with the fewest tokens being scored (a slower replica
    gets less), and the weight transfer covers all of them (the student's and a `self` teacher's engines share
    one). Without a `weight_sync` the engine serves fixed weights (a frozen or external
    teacher) and refuses updates. `api_key`: what servers started with an API key require
    (sent as a bearer token); None: the key of each server this process launched, if it did.
    """

    def __init__(self, urls: Sequence[str], weight_sync: WeightTransfer | None = None, max_concurrency: int = 64,
                 timeout_s: float = 0, retries: int = 3, api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.weight_sync = weight_sync
        self.version = 0
        keys = [api_key or launched_key(url) for url in self.urls]
        self._sends_key = [bool(key) for key in keys]
        models = [_served_model(url, key) for url, key in zip(self.urls, keys)]
        self.model_names = [name for name, _ in models]
        self.max_model_len = min(length for _, length in models)
        self.retries, self.timeout_s = retries, timeout_s
        self._max_concurrency = max_concurrency
        self._loop = _LoopThread()
        self._in_call = 1  # requests of the call being sent (the auto timeout's work)
        self._scoring = [0] * len(self.urls)  # per server: tokens of the scoring requests in flight
        self._clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "EMPTY", max_retries=retries)
                         for url, key in zip(self.urls, keys)]

    # --- sampling -----------------------------------------------------------------------
    supports_full_vocabulary = False
    samples_in_background = True  # the servers are other processes: a request runs while the trainer computes
    batches_itself = True  # the servers schedule their own batches: a caller sends a whole step at once

    @property
    def pushes_verified(self) -> bool:
        """The last push was proven by digest (each is, unless engine.verify_every > 1 skipped it)."""
        return self.weight_sync is None or bool(self.weight_sync.stats.get("sync/verified", 1.0))

    @property
    def max_scored_tokens(self) -> int:
        return self.max_model_len - 1  # scoring asks for one token after the completion

    def completion_states(self, sequences: Sequence[tuple[list[int], list[int]]],
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{self.urls[0]}: a vLLM server returns top-k logprobs, not full next-token "
                                  "distributions; use loss.divergence = 'sampled' or 'topk_reverse_kl'")

    def sample(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Rollout]]:
        check_sample_lengths(prompts, params.max_tokens, self.max_model_len, self._url_of)
        return self._loop.run(self._gather([self._sample_one(i, list(p), params) for i, p in enumerate(prompts)]))

    async def _sample_one(self, index: int, prompt: list[int], params: SamplingParams) -> list[Rollout]:
        # Round-robin by the prompt's place in the whole request: ranks that each sample a
        # share of a step start on different servers.
        server = (params.first_row // params.n + index) % len(self.urls)
        url = self.urls[server]
        return await self._call(server, lambda response: _rollouts(prompt, response, params.n, url),
                                prompt=prompt, n=params.n, max_tokens=params.max_tokens,
                                temperature=params.temperature, top_p=params.top_p,
                                seed=prompt_seed(params, index), logprobs=0,
                                extra_body={"return_token_ids": True, "top_k": params.top_k, "min_p": params.min_p,
                                            "repetition_penalty": 1.0, "skip_special_tokens": True})

    # --- scoring ------------------------------------------------------------------------
    def score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        if temperature != 1.0:
            raise ValueError(f"{', '.join(self.urls)}: vLLM computes prompt logprobs from the raw logits only "
                             f"(temperature 1); scoring at temperature {temperature} needs the local engine")
        self._check_lengths(sequences)
        return self._loop.run(self._gather([self._score_one(i, list(p), list(c), top_k)
                                            for i, (p, c) in enumerate(sequences)]))

    def score_replicas(self, sequence: tuple[list[int], list[int]]) -> list[tuple[str, TokenScores]]:
        """The sequence scored by each server, in order."""
        prompt, completion = sequence
        self._check_lengths([sequence])
        scores = self._loop.run(self._gather([self._score_one(i, list(prompt), list(completion), 0, server=i)
                                              for i in range(len(self.urls))]))
        return list(zip(self.urls, scores))

    def _check_lengths(self, sequences: Sequence[tuple[list[int], list[int]]]) -> None:
        check_score_lengths(sequences, self.max_model_len, lambda index: ", ".join(self.urls))  # any may score it

    def _url_of(self, index: int) -> str:
        """The server that request `index` goes to (round-robin)."""
        return self.urls[index % len(self.urls)]

    async def _score_one(self, index: int, prompt: list[int], completion: list[int], top_k: int,
                         server: int | None = None) -> TokenScores:
        """`server`: the one to ask; None: the one with the fewest tokens being scored (the first of equals),
        chosen when the request is sent."""
        ids = prompt + completion
        if server is None:
            server = min(range(len(self.urls)), key=lambda s: (self._scoring[s], s))
        url = self.urls[server]

        def parse(response: Any) -> TokenScores:
            entries = response.choices[0].model_extra.get("prompt_logprobs")
            return parse_prompt_logprobs(entries, ids, len(prompt), top_k, url)

        self._scoring[server] += len(ids)
        try:
            return await self._call(server, parse, prompt=ids, max_tokens=1, temperature=0.0,
                                    extra_body={"prompt_logprobs": top_k})
        finally:
            self._scoring[server] -= len(ids)

    # --- weights ------------------------------------------------------------------------
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        if self.weight_sync is None:
            raise ServerError(f"{', '.join(self.urls)}: this engine serves fixed weights (no weight sync was set up)")
        self.weight_sync.push(named_tensors, version)
        self.version = version

    def close(self) -> None:
        if self.weight_sync is not None:
            self.weight_sync.close()
        self._loop.run(_all([client.close() for client in self._clients]))
        self._loop.close()

    # --- plumbing -----------------------------------------------------------------------
    async def _gather(self, calls: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
        """Every call, at most max_concurrency at once; without a fixed timeout, while the servers'
        /health is watched (selfopd.serving.liveness)."""
        semaphore = asyncio.Semaphore(self._max_concurrency)

        async def bounded(call: Awaitable[T]) -> T:
            async with semaphore:
                return await call

        self._in_call = max(1, len(calls))  # the latest call's size: only a ceiling reads it
        work = asyncio.gather(*(bounded(call) for call in calls))
        return list(await (work if self.timeout_s else watched(work, self.urls)))

    def _timeout(self, max_tokens: int) -> httpx.Timeout:
        """One request's timeout: engine.request_timeout_s, or (0) the ceiling of its work, the requests
        of one call spread over the servers sharing it."""
        sharing = -(-min(self._in_call, self._max_concurrency) // len(self.urls))
        return request_timeout(self.timeout_s, max_tokens, sharing)

    async def _call(self, server: int, parse: Callable[[Any], T], **request: Any) -> T:
        """One completion request to server `server`, its answer read by `parse`; every
        failure, a malformed answer included, becomes one `ServerError` line naming the URL."""
        url = self.urls[server]
        try:
            response = await self._clients[server].completions.create(
                model=self.model_names[server], timeout=self._timeout(request["max_tokens"]), **request)
        except openai.APIConnectionError as error:  # includes timeouts, after the client's retries
            raise ServerError(f"{url}: {type(error).__name__} after {self.retries} retries: {error}") from None
        except openai.APIStatusError as error:
            if error.status_code == 401:
                raise unauthorized(url, self._sends_key[server]) from None
            raise ServerError(f"{url}: HTTP {error.status_code}: {_error_message(error)}") from None
        except (openai.APIError, ValueError) as error:  # ValueError: the body is not JSON
            raise malformed(url, error) from None
        try:
            return parse(response)
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as error:  # JSON, but not vLLM's answer
            raise malformed(url, error) from None


async def _all(calls: Sequence[Awaitable[Any]]) -> None:
    await asyncio.gather(*calls)


def malformed(url: str, error: Exception) -> ServerError:
    """The error for an answer that is not the JSON a vLLM server sends."""
    return ServerError(f"{url}: malformed answer from the server ({type(error).__name__}: "
                       f"{' '.join(str(error).split())[:300]})")


def prompt_seed(params: SamplingParams, index: int) -> int | None:
    """The seed of prompt `index`'s request: vLLM seeds the n samples of one request seed,
    seed + 1, ..., so prompts are spaced n apart and no two samples share a seed; the call's
    first row offsets them (a rank's share of a step draws what one process does)."""
    return None if params.seed is None else params.seed + params.first_row + index * params.n


def check_sample_lengths(prompts: Sequence[list[int]], max_tokens: int, max_model_len: int,
                         where: Callable[[int], str]) -> None:
    """Refuse, before sending, a prompt that cannot take `max_tokens` more tokens;
    `where(index)` names the server (or instance) it would go to."""
    for index, prompt in enumerate(prompts):
        if len(prompt) + max_tokens > max_model_len:
            raise ServerError(f"{where(index)}: prompt {index} has {len(prompt)} tokens; with max_tokens={max_tokens} "
                              f"it exceeds the server's max_model_len {max_model_len}")


def check_score_lengths(sequences: Sequence[tuple[list[int], list[int]]], max_model_len: int,
                        where: Callable[[int], str]) -> None:
    """Refuse, before sending, a sequence too long to score (scoring generates one token more)."""
    for index, (prompt, completion) in enumerate(sequences):
        if len(prompt) + len(completion) + 1 > max_model_len:
            raise ServerError(
                f"{where(index)}: sequence {index} has {len(prompt)} prompt + {len(completion)} completion tokens; "
                f"scoring needs max_model_len >= prompt + completion + 1, the server has {max_model_len}")


def parse_prompt_logprobs(entries: Sequence[Mapping[str, Any] | None] | None, ids: Sequence[int], start: int,
                          top_k: int, url: str = "") -> TokenScores:
    """vLLM's prompt_logprobs (one dict per prompt position, keyed by token-id strings,
    holding the top k and the actual token) -> logprobs of ids[start:], and the top k.

    vLLM writes -inf as -9999. A top-k alternative at -9999 becomes -inf; the actual token
    at -9999 means the server gives it probability 0 (an id outside its vocabulary, say),
    and raises rather than enter the loss as a huge finite number. Anything else broken (a
    position too many or too few, a missing actual token, NaN, fewer than k ranked
    alternatives, a key or value that is not a number) raises a ServerError naming the URL
    and the position: never a shorter or silently padded tensor.
    """
    if entries is None or len(entries) != len(ids):
        raise ServerError(f"{url}: expected prompt_logprobs for {len(ids)} tokens, got "
                          f"{None if entries is None else len(entries)}")
    length = len(ids) - start
    logprobs = torch.empty(length, dtype=torch.float32)
    topk_ids = torch.zeros(length, top_k, dtype=torch.long) if top_k else None
    topk_logprobs = torch.full((length, top_k), -math.inf) if top_k else None
    for row, position in enumerate(range(start, len(ids))):
        entry = entries[position]
        token = ids[position]
        if not isinstance(entry, Mapping) or str(token) not in entry:
            raise ServerError(f"{url}: prompt_logprobs at position {position} lack the actual token {token}")
        try:
            value = _logprob(entry[str(token)])
            ranked = _top_k(entry, top_k)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ServerError(f"{url}: malformed prompt_logprobs at position {position}: {error!r}") from None
        if value == -math.inf:
            raise ServerError(f"{url}: the server gives token {token} at position {position} probability 0 "
                              "(logprob -inf, sent as -9999): is it outside the served model's vocabulary?")
        logprobs[row] = value
        for column, (token_id, token_logprob) in enumerate(ranked):
            topk_ids[row, column] = token_id
            topk_logprobs[row, column] = token_logprob
    return TokenScores(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_logprobs)


def _logprob(item: Mapping[str, Any]) -> float:
    """The value of one {"logprob": x, "rank": r} item; -9999 and below mean -inf."""
    value = float(item["logprob"])
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"logprob {value}")
    return -math.inf if value <= CLAMPED_LOGPROB else value


def _top_k(entry: Mapping[str, Any], top_k: int) -> list[tuple[int, float]]:
    """(id, logprob) of the alternatives ranked 1..k at one position, best first."""
    if not top_k:
        return []
    ranked = sorted((item["rank"], int(key), _logprob(item)) for key, item in entry.items()
                    if item.get("rank") is not None and item["rank"] <= top_k)
    if len(ranked) < top_k:
        raise ValueError(f"{len(ranked)} alternatives ranked within the top {top_k}")
    return [(token_id, token_logprob) for _, token_id, token_logprob in ranked[:top_k]]


def _rollouts(prompt: list[int], response: Any, n: int, url: str) -> list[Rollout]:
    """The n rollouts of one sampling answer, in the order of their choice index; any other
    number of choices is refused (a missing one would silently shrink the group)."""
    choices = sorted(response.choices, key=lambda choice: choice.index)
    if [choice.index for choice in choices] != list(range(n)):
        raise ServerError(f"{url}: expected {n} completions (choice index 0..{n - 1}), got indices "
                          f"{[choice.index for choice in choices]}")
    return [_rollout(prompt, choice, url) for choice in choices]


def _rollout(prompt: list[int], choice: Any, url: str) -> Rollout:
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    if ids is None:
        raise ServerError(f"{url}: the completion carries no token_ids: the server does not support "
                          "return_token_ids (vLLM >= 0.10.2 does)")
    logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
    return make_rollout(prompt, ids, logprobs, choice.finish_reason, choice.text, url)


def make_rollout(prompt: list[int], ids: Sequence[int], logprobs: Sequence[float] | None, finish_reason: str | None,
                 text: str, where: str) -> Rollout:
    """A `Rollout` from one vLLM completion (a server's JSON or an in-process `CompletionOutput`):
    one sampled logprob per token is required; any finish but "stop" (an end-of-sequence or stop
    token, which vLLM keeps in the ids) counts as "length"."""
    if logprobs is None or len(logprobs) != len(ids):
        raise ServerError(f"{where}: expected one logprob per completion token ({len(ids)}), got "
                          f"{None if logprobs is None else len(logprobs)}")
    finish = "stop" if finish_reason == "stop" else "length"
    return Rollout(prompt_ids=prompt, completion_ids=list(ids), sampler_logprobs=_sampled_logprobs(logprobs, where),
                   finish_reason=finish, text=text)


def _sampled_logprobs(logprobs: Sequence[Any], where: str) -> list[float]:
    """The sampled tokens' logprobs as floats. A sampled token had probability > 0, so a
    missing, NaN or infinite value (-9999 is vLLM's -inf) is a broken reply, refused here
    rather than turned into an infinite importance ratio in the loss."""
    values = []
    for position, value in enumerate(logprobs):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number <= CLAMPED_LOGPROB:
            raise ServerError(f"{where}: completion token {position} has logprob {value!r}; a sampled token "
                              "needs a finite one")
        values.append(number)
    return values


def _served_model(url: str, api_key: str | None = None) -> tuple[str, int]:
    """(model name, max_model_len) from GET /v1/models, and a release selfopd can drive (GET
    /version): the first sign of a wrong URL, key or server."""
    try:
        response = httpx.get(f"{url}/v1/models", timeout=30, headers=auth_headers(api_key))
        if response.status_code == 401:
            raise unauthorized(url, bool(api_key))
        response.raise_for_status()
        (model, *_) = response.json()["data"]
        version = httpx.get(f"{url}/version", timeout=30, headers=auth_headers(api_key)).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        raise ServerError(f"{url}: not a reachable vLLM server ({type(error).__name__}: {error})") from None
    problem = vllm_version_problem(url, str(version))
    if problem:
        raise ServerError(problem)
    return model["id"], int(model.get("max_model_len") or 0) or 2**31


def _error_message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)[:500]
    return str(error)[:500]


class _LoopThread:
    """An event loop in a daemon thread: sync callers submit coroutines and wait."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="selfopd-vllm-client", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
