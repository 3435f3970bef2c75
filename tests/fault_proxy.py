"""A fault-injecting HTTP proxy in front of a real vLLM server, run as its own process.

    python tests/fault_proxy.py PORT TARGET_URL

It forwards every request to TARGET_URL (weight-sync routes included) and, on the
completion route, misbehaves as the last `POST /__fault__ {"mode": ..., ...}` said:

- "pass": forward untouched;
- "slow": answer `delay_s` seconds late;
- "garbled": answer 200 with a truncated JSON body;
- "short" / "extra": drop the last / repeat the last entry of every choice's
  prompt_logprobs (scoring) or token logprobs (sampling);
- "fewer_choices": drop the last of an answer's n completions;
- "kill": SIGKILL itself on the `after`-th completion request once the server holds
  weight version `after_version` (from now, without one): a server that dies at a chosen
  point of a training step, its connections cut;
- "cache_busy": answer `/reset_prefix_cache` with success false (HTTP 200), as vLLM does
  while blocks are still held.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

COMPLETIONS = "/v1/completions"


class FaultProxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects
    target = ""
    client: httpx.Client
    fault: dict = {"mode": "pass"}
    seen = 0
    armed = True

    def do_GET(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/__fault__":
            type(self).fault, type(self).seen = json.loads(body), 0
            type(self).armed = self.fault.get("after_version") is None
            return self._answer(200, b"{}")
        if self.path == "/reset_prefix_cache" and self.fault["mode"] == "cache_busy":
            return self._answer(200, b'{"success": false}')
        mode = self.fault["mode"] if self.path.startswith(COMPLETIONS) else "pass"
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
        if mode == "kill" and not self.armed:  # the server's own version: a push may reach it by another URL
            key = {k: v for k, v in headers.items() if k.lower() == "authorization"}  # the server wants its key here too
            version = self.client.get(self.target + "/weight_info", headers=key).json().get("weight_version")
            type(self).armed = version == self.fault.get("after_version")
        if mode == "kill" and self.armed:
            type(self).seen += 1
            if self.seen >= self.fault.get("after", 1):
                os.kill(os.getpid(), signal.SIGKILL)
        if mode == "garbled":
            return self._answer(200, b'{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "te')
        response = self.client.request(self.command, self.target + self.path, content=body, headers=headers)
        content = response.content
        if mode in ("short", "extra", "fewer_choices") and response.status_code == 200:
            content = json.dumps(_resized(response.json(), mode)).encode()
        if mode == "slow":
            time.sleep(self.fault.get("delay_s", 30))
        self._answer(response.status_code, content)

    def _answer(self, status: int, content: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout): nothing to answer
            pass

    def log_message(self, *args) -> None:  # quiet
        pass


def _resized(answer: dict, mode: str) -> dict:
    """Every choice's logprob list one entry shorter ("short") or longer ("extra"), or one
    choice fewer ("fewer_choices")."""
    if mode == "fewer_choices":
        answer["choices"].pop()
        return answer
    for choice in answer["choices"]:
        if choice.get("prompt_logprobs"):
            entries = choice["prompt_logprobs"]
        else:
            entries = choice["logprobs"]["token_logprobs"]
        if mode == "short":
            entries.pop()
        else:
            entries.append(entries[-1])
    return answer


def main() -> None:
    port, target = int(sys.argv[1]), sys.argv[2].rstrip("/")
    FaultProxy.target, FaultProxy.client = target, httpx.Client(timeout=600)
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", port), FaultProxy)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
