"""How long a request to a vLLM server may take, and how a dead server is told from a slow one.

A fixed timeout per request (`engine.request_timeout_s` > 0) counts the time a request waits
in vLLM's queue behind the others of its step, and the retry that follows a timeout starts the
generation again. With `engine.request_timeout_s = 0` (the default) a request instead gets a
ceiling that grows with its work (`request_ceiling`), and while requests are in flight each
server's `/health` is polled (`watch_health`): a server that stops answering (dead, hung,
unreachable) is found within a minute, while a live server that is slow (long completions, a deep
queue) is waited for. A server found dead is handed to `on_dead` (the engine drops it from the
rotation and resends its requests to another replica); without `on_dead`, or once no replica of
the role is left, the step fails with one line naming its URL.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence, TypeVar

import httpx

from selfopd.serving.server import ServerError

T = TypeVar("T")
BASE_S = 600.0  # the ceiling of a request with no work (prefill, a weight push's pause): the old fixed timeout
PER_TOKEN_S = 0.25  # per token asked for, times the requests that share the server: ~4 tokens/s each
HEALTH_EVERY_S = 5.0  # between two polls of /health
HEALTH_TIMEOUT_S = 10.0  # one poll's limit
HEALTH_FAILURES = 3  # polls in a row without a 200: the server is dead (within 3 x (5 + 10) = 45 s)


def request_ceiling(max_tokens: int, sharing: int) -> float:
    """Seconds one request may take under `engine.request_timeout_s = 0`: BASE_S plus PER_TOKEN_S per
    token it may generate, times the `sharing` requests sent to its server together (vLLM runs them
    in one batch at best, one after another at worst)."""
    return BASE_S + PER_TOKEN_S * max_tokens * max(1, sharing)


def timeout_rule() -> str:
    """The rule of `engine.request_timeout_s = 0`, as `--show-config` prints it."""
    return (f"no fixed timeout: each request may take {BASE_S:.0f} s + {PER_TOKEN_S} s x max_tokens x the requests "
            f"sent to its server together, while /health is polled every {HEALTH_EVERY_S:.0f} s; "
            f"{HEALTH_FAILURES} polls in a row without an answer drop the server from the rotation, and fail the "
            "step once no replica is left")


def request_timeout(timeout_s: float, max_tokens: int, sharing: int) -> httpx.Timeout:
    """The httpx timeout of one request: `timeout_s` when set, else the work's ceiling (connecting
    to a server still fails within HEALTH_TIMEOUT_S)."""
    if timeout_s:
        return httpx.Timeout(timeout_s)
    return httpx.Timeout(request_ceiling(max_tokens, sharing), connect=HEALTH_TIMEOUT_S)


async def watch_health(urls: Sequence[str], on_dead: Callable[[str, str], None] | None = None) -> None:
    """Poll each server's /health until cancelled. A server that fails HEALTH_FAILURES polls in a row (no
    answer, or an answer other than 200) is dead: `on_dead(url, one-line reason)` is called and the
    server no longer polled; without `on_dead`, a ServerError with that line is raised."""
    failures = dict.fromkeys(urls, 0)
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:

        async def poll(url: str) -> str | None:
            try:
                status = (await client.get(f"{url}/health")).status_code
            except httpx.HTTPError as error:
                return type(error).__name__
            return None if status == 200 else f"HTTP {status}"

        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            polled = list(failures)
            problems = await asyncio.gather(*(poll(url) for url in polled))
            for url, problem in zip(polled, problems):
                failures[url] = failures[url] + 1 if problem else 0
                if failures[url] >= HEALTH_FAILURES:
                    reason = (f"{url}: {url}/health failed {HEALTH_FAILURES} polls in a row ({problem}) "
                              "while requests waited on the server: it is down or hung")
                    if on_dead is None:
                        raise ServerError(reason)
                    del failures[url]
                    on_dead(url, reason)


async def health_answers(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether `url`/health answers 200 now (a dropped replica's re-admission asks this first)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def watched(work: Awaitable[T], urls: Sequence[str], on_dead: Callable[[str, str], None] | None = None) -> T:
    """`work`'s result, or the ServerError of `watch_health` (the work then cancelled) if a server
    stops answering /health first; with `on_dead`, a dead server is handed to it and the work goes on."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(watch_health(urls, on_dead))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            pending.cancel()  # nothing for one that is done
        await asyncio.gather(task, watch, return_exceptions=True)
    if task not in done:
        watch.result()  # raises the server's ServerError
    return task.result()
