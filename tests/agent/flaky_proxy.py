"""A reverse proxy in front of a real ampwatch server that answers 503 while told to:
the "server failing for a while" of the delivery tests, as a process of its own.

    python -m tests.agent.flaky_proxy UPSTREAM_URL PORT

`POST /_proxy/fail` starts answering 503 to everything else, `POST /_proxy/pass` forwards
again; `GET /_proxy/stats` -> {"failed": n, "forwarded": m}. Prints "ready" when listening.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

FORWARDED_HEADERS = ("content-type", "content-encoding", "authorization")


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the agent's client expects
    upstream: httpx.Client
    failing = False
    stats = {"failed": 0, "forwarded": 0}
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        cls = type(self)
        if self.path.startswith("/_proxy/"):
            if self.path == "/_proxy/fail":
                cls.failing = True
            elif self.path == "/_proxy/pass":
                cls.failing = False
            with cls.lock:
                self._answer(200, json.dumps(cls.stats).encode())
            return
        if cls.failing:
            with cls.lock:
                cls.stats["failed"] += 1
            self._answer(503, b'{"detail": "proxy told to fail"}')
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
        reply = cls.upstream.request(self.command, self.path, content=body, headers=headers)
        with cls.lock:
            cls.stats["forwarded"] += 1
        self._answer(reply.status_code, reply.content,
                     reply.headers.get("content-type", "application/json"))

    do_GET = do_PUT = do_POST = do_DELETE = _handle


def main() -> None:
    upstream, port = sys.argv[1], int(sys.argv[2])
    Proxy.upstream = httpx.Client(base_url=upstream, timeout=30)
    server = ThreadingHTTPServer(("127.0.0.1", port), Proxy)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
