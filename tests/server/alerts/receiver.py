"""A real HTTP receiver for alert tests: http.server on 127.0.0.1 in a thread, recording
every JSON body it accepts. It can answer errors first, and stop and start again on the
same port (a target that is down, then back)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.conftest import free_port


class Receiver:
    """`url` takes POSTs; `accepted` holds the bodies answered 2xx, `requests` counts all.
    `fail_next(n, status)` answers the next n requests with `status`."""

    def __init__(self, path: str = "/hook?key=s3cret-token") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{path}"
        self.accepted: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.requests = 0
        self.delay = 0.0  # seconds before answering
        self._failures: list[int] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def fail_next(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._failures = [status] * n

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                time.sleep(receiver.delay)
                with receiver._lock:
                    receiver.requests += 1
                    status = receiver._failures.pop(0) if receiver._failures else 200
                    if status == 200:
                        receiver.accepted.append(json.loads(body))
                        receiver.headers.append(dict(self.headers))
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Block until `count` notifications were accepted (fails after `timeout`)."""
        wait_until(lambda: len(self.accepted) >= count, timeout,
                   lambda: f"{len(self.accepted)} of {count} notifications arrived")
        return self.accepted


def wait_until(condition: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s: {what()}")
        time.sleep(0.05)
