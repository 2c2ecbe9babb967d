"""The middleware that times batch POSTs (and counts their bytes) and dashboard pages
into the process's `ServerMetrics` (server/metrics.py)."""

from __future__ import annotations

import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.server.metrics import ServerMetrics

INGEST_PATH = re.compile(r"^/api/v1/runs/[^/]+/batches$")
# dashboard pages by route, so the page label has a handful of values
PAGES = (
    ("runs", re.compile(r"^/$")),
    ("run", re.compile(r"^/runs/[^/]+/?$")),
    ("layers", re.compile(r"^/runs/[^/]+/layers/?$")),
    ("compare", re.compile(r"^/compare/?$")),
)


class MetricsMiddleware:
    """Times batch POSTs (and counts their bytes as received) and dashboard pages.
    Outermost, so the bytes are those on the wire and the time includes the body."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and INGEST_PATH.match(path):
            await self._ingest(scope, receive, send)
            return
        page = next((name for name, pattern in PAGES if pattern.match(path)), None) \
            if method == "GET" else None
        if page is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.page_seconds.labels(page).observe(time.perf_counter() - start)

    async def _ingest(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics
        status = [500]

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                metrics.ingest_bytes.inc(len(message.get("body", b"")))
            return message

        async def status_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, counting_receive, status_send)
        finally:
            metrics.ingest_seconds.observe(time.perf_counter() - start)
            metrics.ingest_requests.labels(str(status[0])).inc()
