"""The `analysis_wait_s` setting: reads wait for the analysis queue to drain first, so a
read right after ingest sees the findings of what was stored before it."""

from __future__ import annotations

import anyio
from sqlalchemy.orm import sessionmaker
from starlette.types import ASGIApp, Receive, Scope, Send

from ampwatch.server.worker.analysis_worker import AnalysisWorker, settle


class AnalysisWaitMiddleware:
    """GET and HEAD requests (health and metrics excepted) first wait, up to `wait_s`, for
    the analysis queue to be empty: a read right after ingest then sees the findings of
    what was stored before it (the `analysis_wait_s` setting). Waits off the event loop;
    costs one count of the queue when it is empty."""

    exempt = ("/api/v1/health", "/metrics")

    def __init__(self, app: ASGIApp, maker: sessionmaker, worker: AnalysisWorker | None,
                 wait_s: float) -> None:
        self.app = app
        self.maker = maker
        self.worker = worker
        self.wait_s = wait_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] in ("GET", "HEAD")
                and not scope["path"].startswith(self.exempt)):
            await anyio.to_thread.run_sync(self._settle)
        await self.app(scope, receive, send)

    def _settle(self) -> None:
        settle(self.maker, self.worker, self.wait_s)
