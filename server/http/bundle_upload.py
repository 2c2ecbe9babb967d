"""A flight-recorder bundle's upload (PUT /api/v1/runs/{id}/bundles/{rank}/{step}) taken
to a file before the request takes a request slot, under one deadline for the whole body:
a client trickling a bundle holds a connection and its bytes on disk, never a slot, and
is cut off at the deadline however it paces its chunks."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.server.http.middleware import BUNDLE_UPLOAD, error_response
from ampwatch.server.settings import Settings
from ampwatch.wire import RUN_ID_PATTERN

BUNDLE_TYPES = ("application/zip", "application/octet-stream")
UPLOADED_BUNDLE = "ampwatch.uploaded_bundle"  # scope key: the file the body was written to
_RUN_ID = re.compile(RUN_ID_PATTERN)


class BundleUploadMiddleware:
    """Writes a bundle upload's body to a file in the bundle folder (the route moves it in
    place), at most `bundle_max_bytes` (413), within `bundle_timeout_s` from its first
    byte to its last (408); `settings` read per request, as the route reads them.
    An upload the route refuses anyway (a run `known_run` does not know, another
    Content-Type) passes through unread, so its 404 or 422 comes before the body."""

    def __init__(self, app: ASGIApp, settings: Settings,
                 known_run: Callable[[str], bool]) -> None:
        self.app = app
        self.settings = settings
        self.known_run = known_run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "PUT"
                and BUNDLE_UPLOAD.fullmatch(scope["path"])):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
        run_id = scope["path"].split("/")[4]
        if media not in BUNDLE_TYPES or not _RUN_ID.fullmatch(run_id) or not (
                await run_in_threadpool(self.known_run, run_id)):
            await self.app(scope, receive, send)  # the route refuses it, body unread
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.settings.bundle_max_bytes:
            await error_response(send, 413, self._too_large())
            return
        incoming = self.settings.bundle_folder / ".incoming"
        await run_in_threadpool(incoming.mkdir, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=incoming, suffix=".part")
        upload = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                if not await self._receive_into(out, receive, send):
                    return
            await self.app({**scope, UPLOADED_BUNDLE: upload}, _no_more_body(receive), send)
        finally:
            upload.unlink(missing_ok=True)

    async def _receive_into(self, out: BinaryIO, receive: Receive, send: Send) -> bool:
        """The whole body into `out`; False when it was answered (413, 408) or the
        client left."""
        size, timeout_s = 0, self.settings.bundle_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return False
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.settings.bundle_max_bytes:
                        await error_response(send, 413, self._too_large())
                        return False
                    if chunk:
                        await run_in_threadpool(out.write, chunk)
                    if not message.get("more_body", False):
                        return True
        except TimeoutError:
            await error_response(send, 408, f"the bundle did not arrive within "
                                 f"{timeout_s:g} s (AMPWATCH_BUNDLE_TIMEOUT_S)")
            return False

    def _too_large(self) -> str:
        return (f"bundle over the limit of {self.settings.bundle_max_bytes} bytes "
                "(AMPWATCH_BUNDLE_MAX_BYTES)")


def _no_more_body(receive: Receive) -> Receive:
    """The route's `receive`: an empty last body (it was written to the file), then the
    client's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": b"", "more_body": False}

    return replay
