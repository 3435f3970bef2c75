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

A replica that stops answering (connection refused or reset, a timeout or a 502/503/504 after
those retries, or /health failing while its requests wait) is dropped from the rotation with one
warning naming its URL, and its requests are sent again to another live replica of the engine:
nothing already computed is lost. The call fails, with the last replica's line, only once no
replica is left. `readmit` (once per step, at the weight push) puts a dropped replica back once
its /health answers and, for a server that serves the trainer's weights, the push proved by
digest that it holds them.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Sequence, TypeVar

import httpx
import openai
import torch

from selfopd.engines.base import Rollout, SamplingParams, TokenScores, WeightSource
from selfopd.serving.liveness import health_answers, request_timeout, watched
from selfopd.serving.server import (ServerError, auth_headers, launched_key, relaunch_if_exited, unauthorized,
                                    vllm_version_problem)
from selfopd.serving.vllm_answers import (check_sample_lengths, check_score_lengths, malformed, parse_prompt_logprobs,
                                          rollouts)
from selfopd.serving.weight_sync import WeightTransfer

T = TypeVar("T")
GONE = frozenset({502, 503, 504})  # after the retries: no server behind the URL (a proxy's answer), not a bad request


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
        self.dropped: dict[int, str] = {}  # server -> why it left the rotation (its one-line error)
        self._down = [asyncio.Event() for _ in self.urls]  # set when a server is dropped: its requests move on

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
        # Round-robin over the live servers by the prompt's place in the whole request: ranks that
        # each sample a share of a step start on different servers.
        def server() -> int:
            live = self.live()
            return live[(params.first_row // params.n + index) % len(live)]

        return await self._call(server, lambda response, url: rollouts(prompt, response, params.n, url),
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
        """The sequence scored by each live server, in order (one that dies meanwhile: by another)."""
        prompt, completion = sequence
        self._check_lengths([sequence])
        live = self.live()
        scores = self._loop.run(self._gather([self._score_one(i, list(prompt), list(completion), 0, server=i)
                                              for i in live]))
        return [(self.urls[i], score) for i, score in zip(live, scores)]

    def _check_lengths(self, sequences: Sequence[tuple[list[int], list[int]]]) -> None:
        check_score_lengths(sequences, self.max_model_len, lambda index: ", ".join(self.urls))  # any may score it

    def _url_of(self, index: int) -> str:
        """The server that request `index` goes to (round-robin)."""
        return self.urls[index % len(self.urls)]

    async def _score_one(self, index: int, prompt: list[int], completion: list[int], top_k: int,
                         server: int | None = None) -> TokenScores:
        """`server`: the one to ask while it is live; None (or once it is dropped): the live one with the
        fewest tokens being scored (the first of equals), chosen when the request is sent."""
        ids = prompt + completion
        asked = server

        def choose() -> int:
            live = self.live()
            return asked if asked in live else min(live, key=lambda s: (self._scoring[s], s))

        def parse(response: Any, url: str) -> TokenScores:
            entries = response.choices[0].model_extra.get("prompt_logprobs")
            return parse_prompt_logprobs(entries, ids, len(prompt), top_k, url)

        return await self._call(choose, parse, load=len(ids), prompt=ids, max_tokens=1, temperature=0.0,
                                extra_body={"prompt_logprobs": top_k})

    # --- weights ------------------------------------------------------------------------
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        if self.weight_sync is None:
            raise ServerError(f"{', '.join(self.urls)}: this engine serves fixed weights (no weight sync was set up)")
        self.weight_sync.push(named_tensors, version)
        self.version = version

    # --- replicas -----------------------------------------------------------------------
    def live(self) -> list[int]:
        """The servers in the rotation; a ServerError (the last dropped one's line) once none is left."""
        live = [server for server in range(len(self.urls)) if server not in self.dropped]
        if not live:
            *_, last = self.dropped.values()
            raise ServerError(last if len(self.urls) == 1 else f"{last} (no live replica left of {', '.join(self.urls)})")
        return live

    def drop(self, server: int, reason: str) -> None:
        """Take `server` out of the rotation (one warning naming it); its requests in flight move on."""
        if server in self.dropped:
            return
        self.dropped[server] = reason
        self._down[server].set()
        if len(self.dropped) < len(self.urls):
            print(f"selfopd: warning: {self.urls[server]} dropped from the rotation, its requests resent to another "
                  f"replica; it is re-added once it answers again ({reason})", file=sys.stderr, flush=True)

    def readmit(self) -> list[str]:
        """Put back each dropped server whose /health answers and, with a weight sync, that holds the weights
        of the last push, proven by digest (`WeightTransfer.holds`). Called once per step, after the push:
        a re-added server gets no request before it holds the weights. Returns the re-added URLs."""
        back = []
        for server in sorted(self.dropped):
            url = self.urls[server]
            if relaunch_if_exited(url) or not self._loop.run(health_answers(url)):  # a launched one: started again
                continue
            if self.weight_sync is not None and not self.weight_sync.holds(url, self.version):
                continue
            del self.dropped[server]
            self._down[server] = asyncio.Event()
            print(f"selfopd: {url} answers again and holds weight version {self.version}: re-added to the rotation",
                  file=sys.stderr, flush=True)
            back.append(url)
        return back

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
        if self.timeout_s:
            return list(await work)
        watched_urls = [self.urls[server] for server in self.live()]
        return list(await watched(work, watched_urls, lambda url, reason: self.drop(self.urls.index(url), reason)))

    def _timeout(self, max_tokens: int) -> httpx.Timeout:
        """One request's timeout: engine.request_timeout_s, or (0) the ceiling of its work, the requests
        of one call spread over the live servers sharing it."""
        sharing = -(-min(self._in_call, self._max_concurrency) // max(1, len(self.urls) - len(self.dropped)))
        return request_timeout(self.timeout_s, max_tokens, sharing)

    async def _call(self, choose: Callable[[], int], parse: Callable[[Any, str], T], load: int = 0,
                    **request: Any) -> T:
        """One completion request to the server `choose()` names, its answer read by `parse(answer, url)`.
        A server that stops answering is dropped and the request sent to the one `choose()` names next
        (ServerError once none is left); any other failure, a malformed answer included, becomes one
        `ServerError` line naming the URL. `load`: tokens counted as being scored by the server meanwhile."""
        while True:
            server = choose()
            self._scoring[server] += load
            try:
                return await self._call_once(server, parse, **request)
            except _ServerDown as down:
                self.drop(server, str(down))
            finally:
                self._scoring[server] -= load

    async def _call_once(self, server: int, parse: Callable[[Any, str], T], **request: Any) -> T:
        """The request to `server`; _ServerDown when the server stops answering (after the client's retries,
        or once it is dropped while the request waits)."""
        url = self.urls[server]
        sent = asyncio.ensure_future(self._clients[server].completions.create(
            model=self.model_names[server], timeout=self._timeout(request["max_tokens"]), **request))
        down = asyncio.ensure_future(self._down[server].wait())
        try:
            await asyncio.wait({sent, down}, return_when=asyncio.FIRST_COMPLETED)
            if not sent.done():
                raise _ServerDown(self.dropped.get(server, f"{url}: dropped"))
            response = sent.result()
        except openai.APIConnectionError as error:  # includes timeouts, after the client's retries
            raise _ServerDown(f"{url}: {type(error).__name__} after {self.retries} retries: {error}") from None
        except openai.APIStatusError as error:
            if error.status_code == 401:
                raise unauthorized(url, self._sends_key[server]) from None
            message = f"{url}: HTTP {error.status_code}: {_error_message(error)}"
            raise (_ServerDown if error.status_code in GONE else ServerError)(message) from None
        except (openai.APIError, ValueError) as error:  # ValueError: the body is not JSON
            raise malformed(url, error) from None
        finally:
            for pending in (sent, down):
                pending.cancel()
        try:
            return parse(response, url)
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as error:  # JSON, but not vLLM's answer
            raise malformed(url, error) from None


class _ServerDown(Exception):
    """A server stopped answering (its one-line reason): `_call` drops it and resends the request."""


async def _all(calls: Sequence[Awaitable[Any]]) -> None:
    await asyncio.gather(*calls)


def prompt_seed(params: SamplingParams, index: int) -> int | None:
    """The seed of prompt `index`'s request: vLLM seeds the n samples of one request seed,
    seed + 1, ..., so prompts are spaced n apart and no two samples share a seed; the call's
    first row offsets them (a rank's share of a step draws what one process does)."""
    return None if params.seed is None else params.seed + params.first_row + index * params.n


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
