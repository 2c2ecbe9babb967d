"""Back-pressure on ingest when analysis is truly behind: while more batches await
analysis than AMPWATCH_MAX_PENDING_BATCHES, new batches are answered 503 + Retry-After
before their bodies are read, and the agents keep them in their spools meanwhile.
Ordinary load never meets it: the request slots (`guards.RequestSlotMiddleware`) queue
requests rather than refuse them."""

from __future__ import annotations

import contextlib
import re
import time

from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from ampwatch.server.faults import DATABASE_ERRORS
from ampwatch.server.http.middleware import error_response
from ampwatch.server.worker.queue import pending_batches

BATCH_POST = re.compile(r"/api/v1/runs/[^/]+/batches")


class BacklogMiddleware:
    """Answers a batch POST 503 + Retry-After while more than `limit` batches await
    analysis, before its body is read. The queue's depth is read at most once every
    `REFRESH_S`, off the event loop, by whichever request comes first; the others use the
    last reading, so a server adds one count a second to the database whatever its load."""

    REFRESH_S = 1.0
    RETRY_AFTER_S = 5  # workers drain thousands of batches in that time

    def __init__(self, app: ASGIApp, maker: sessionmaker, limit: int) -> None:
        self.app = app
        self.maker = maker
        self.limit = limit
        self.depth = 0
        self._read_at = float("-inf")
        self._reading = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and BATCH_POST.fullmatch(scope["path"])):
            await self._refresh()
            if self.depth > self.limit:
                await error_response(send, 503, f"{self.depth} batches await analysis, over "
                                     f"{self.limit} (AMPWATCH_MAX_PENDING_BATCHES): the "
                                     "analysis workers are behind; retry",
                                     retry_after=self.RETRY_AFTER_S)
                return
        await self.app(scope, receive, send)

    async def _refresh(self) -> None:
        if self._reading or time.monotonic() - self._read_at < self.REFRESH_S:
            return
        self._reading = True
        try:
            # a database that cannot answer fails the batch itself, with its own reason
            with contextlib.suppress(*DATABASE_ERRORS):
                self.depth = await run_in_threadpool(self._read)
        finally:
            self._read_at = time.monotonic()
            self._reading = False

    def _read(self) -> int:
        with self.maker() as session:
            return pending_batches(session)
