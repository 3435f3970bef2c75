"""The control side of a running vLLM server: its dev-mode HTTP routes (pause, resume, the prefix
cache, the weight version, worker calls through `/collective_rpc`), with errors that name the URL,
and the small helpers the weight push uses to run calls beside a collective with deadlines.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import httpx

from selfopd.serving.server import ServerError, auth_headers, launched_key, unauthorized
from selfopd.serving.weight_digest import WeightSyncError

CONTROL_TIMEOUT_S = 600.0  # a control route (pause, reset the cache, a worker call) unless a timeout is set
# vLLM's HTTP server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default). A client
# that keeps it as long can send on it just as the server closes it, and gets "Server disconnected without
# sending a response"; dropping idle connections sooner leaves no such window.
KEEPALIVE_EXPIRY_S = 2.0


class ServerControl:
    """The dev-mode HTTP routes of one vLLM server, with errors that name the URL. `api_key`: the
    server's key; None: the key of the server this process launched at `url`, if it did."""

    def __init__(self, url: str, timeout_s: float = CONTROL_TIMEOUT_S, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key or launched_key(self.url)
        self._sends_key = bool(self.api_key)
        self._client = httpx.Client(timeout=timeout_s, headers=auth_headers(self.api_key),
                                   limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))

    def request(self, method: str, path: str, timeout: float | None | object = httpx.USE_CLIENT_DEFAULT,
                **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, self.url + path, timeout=timeout, **kwargs)
        except httpx.HTTPError as error:
            raise ServerError(f"{self.url}{path}: {type(error).__name__}: {error or 'no answer'}") from None
        if response.status_code == 401:
            raise unauthorized(self.url + path, self._sends_key)
        if response.status_code == 404:
            raise ServerError(f"{self.url}{path}: not found (404). This route needs a vLLM server started with "
                              "VLLM_SERVER_DEV_MODE=1 and selfopd's worker extension, as `selfopd serve` does")
        if response.status_code >= 400:
            raise ServerError(f"{self.url}{path}: HTTP {response.status_code}: {' '.join(response.text.split())[:400]}")
        return response.json() if response.content else None

    def pause(self, keep: bool = False) -> None:
        """Stop serving for a weight update: once the requests in flight finish, or (`keep`) at
        once, with the requests in flight frozen where they are, to go on after `resume`."""
        self.request("POST", "/pause", params={"mode": "keep" if keep else "wait"})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def reset_prefix_cache(self, running: bool = False) -> None:
        """Drop the prefix cache; vLLM answers success false (HTTP 200) while blocks are still held.
        `running`: also the cache of the requests frozen by `pause(keep=True)`, which vLLM preempts:
        each recomputes its prompt and the tokens it has so far with the new weights when it resumes."""
        answer = self.request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"} if running else None)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise ServerError(f"{self.url}/reset_prefix_cache: the server did not reset its prefix cache ({answer!r}); "
                              "prefixes cached with the old weights would make the next rollouts off-policy")

    def version(self) -> str | None:
        return self.request("GET", "/weight_info")["weight_version"]

    def world_size(self) -> int:
        """The server's workers (TP x PP x DP): each is one rank of the transfer group."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def rpc(self, method: str, timeout: float | None | object = httpx.USE_CLIENT_DEFAULT) -> list[Any]:
        """Call a worker method of selfopd's worker extension on every worker; one answer each."""
        return self.request("POST", "/collective_rpc", json={"method": method}, timeout=timeout)["results"]

    def close(self) -> None:
        self._client.close()


def in_background(call: Callable[[], Any]) -> Future:
    """`call` on a daemon thread (a peer that never answers must not keep the process alive)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


def wait_all(calls: Sequence[tuple[ServerControl | None, Future]], timeout_s: float | None, what: str) -> None:
    """Wait for every call; the first failure (or the deadline) raises one line naming the server."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(calls)
    while pending:
        for control, future in list(pending):
            if future.done():
                pending.remove((control, future))
                if future.exception() is not None:
                    error = future.exception()
                    if isinstance(error, (ServerError, WeightSyncError)):
                        raise error
                    where = control.url if control is not None else "the trainer's side"
                    raise ServerError(f"{where}: {what} failed: {type(error).__name__}: "
                                      f"{' '.join(str(error).split())[:300]}") from None
        if pending and deadline is not None and time.monotonic() > deadline:
            names = ", ".join(c.url if c is not None else "the trainer's side" for c, _ in pending)
            raise ServerError(f"{names}: {what} took more than {timeout_s:.0f} s (engine.sync_timeout_s)")
        if pending:
            time.sleep(0.02)
