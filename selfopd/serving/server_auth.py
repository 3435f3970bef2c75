"""The keys of the servers selfopd launches, and the ASGI middleware that requires one on every route.

vLLM's own API key (`VLLM_API_KEY`) guards only `/v1`-style routes; the dev routes a weight push
drives (`/pause`, `/collective_rpc`, `/init_weight_transfer_engine`, `/update_weights`, ...) answer
whoever reaches the port. A launched server therefore runs `--middleware` `RequireKey`, which
refuses every request but `GET /health` (the readiness probe) without the server's key: 401 and
`{"error": "Unauthorized: ..."}`. The key reaches the server in its environment, never on a command
line (`ps` shows those to every user), and is generated per launch when none is configured.

The weight push's own secret (`transfer_secret`) is derived from the key: the server's workers get it
in their environment at launch, the trainer, which holds the key, derives it and sends it with the
transfer's init; a worker refuses an init without it (`selfopd.serving.vllm_worker`).

Runs in vLLM's API process: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Any, Awaitable, Callable

KEY_ENV = "VLLM_API_KEY"  # where a launched server finds its key (vLLM's own /v1 check reads it too)
SECRET_ENV = "SELFOPD_TRANSFER_SECRET"  # the weight push's secret, in the server's environment
TRAINER_ENV = "SELFOPD_TRAINER_ADDRESS"  # the one address a server's workers accept a weight push from
OPEN_PATHS = frozenset({"/health"})
REFUSED = json.dumps({"error": "Unauthorized: this server requires its API key (Authorization: Bearer KEY); "
                               "selfopd reads it from the variable engine.api_key_env names"}).encode()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def new_key() -> str:
    """A fresh server key (256 random bits)."""
    return secrets.token_urlsafe(32)


def transfer_secret(key: str) -> str:
    """The weight push's secret for a server whose API key is `key` ("" without a key)."""
    return hmac.new(key.encode(), b"selfopd weight transfer", hashlib.sha256).hexdigest() if key else ""


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality of two secrets; an empty expected secret matches nothing."""
    return bool(expected) and hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                                  hashlib.sha256(expected.encode()).digest())


class RequireKey:
    """ASGI middleware: every HTTP and websocket request but those to `OPEN_PATHS` must carry
    `Authorization: Bearer KEY`, KEY being `$VLLM_API_KEY` of the server's process. Without a key
    in the environment every such request is refused (a server is never left open by mistake)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self._key = os.environ.get(KEY_ENV, "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation: HTTP 403 to the client
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(REFUSED)).encode())]})
            await send({"type": "http.response.body", "body": REFUSED})

    def _allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and same_secret(token.strip(), self._key)
