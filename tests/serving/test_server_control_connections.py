"""The control client and vLLM's HTTP keep-alive: a connection left idle is dropped by the client
before the server's keep-alive timeout can close it under a request in flight (CI once lost a
digest request to exactly that race: "Server disconnected without sending a response")."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from selfopd.serving.server_control import KEEPALIVE_EXPIRY_S, ServerControl


class CountingHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive; records the client port of each request (one port per connection)."""

    protocol_version = "HTTP/1.1"
    ports: list[int] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        CountingHandler.ports.append(self.client_address[1])
        body = b'{"version": "1"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    CountingHandler.ports = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), CountingHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_idle_connections_expire_before_vllms_keep_alive_closes_them(server):
    import vllm.envs

    assert KEEPALIVE_EXPIRY_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    control = ServerControl(server, api_key="k")
    control.request("GET", "/version")
    control.request("GET", "/version")
    assert len(set(CountingHandler.ports)) == 1  # back to back: the connection is reused
    time.sleep(KEEPALIVE_EXPIRY_S + 0.5)
    control.request("GET", "/version")
    assert len(set(CountingHandler.ports)) == 2  # idle past the expiry: a fresh connection, never the stale one
