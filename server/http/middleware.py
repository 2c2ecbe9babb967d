"""Pure ASGI middleware: request body limits and gzip request bodies, security headers,
the docs pages' content policy. Who may hold a slot or write is in `guards.py`."""

from __future__ import annotations

import asyncio
import json
import re
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from zlib_ng import zlib_ng as zlib  # zlib's API; inflates a gzip batch in half the time

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
HEALTH_PATH = "/api/v1/health"
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
]


BUNDLE_UPLOAD = re.compile(r"/api/v1/runs/[^/]+/bundles/\d+/\d+")


class RequestBodyMiddleware:
    """Rejects bodies over `max_bytes` (413) before any route runs, and inflates
    `Content-Encoding: gzip` bodies (the limit applies after inflation, so a small
    gzip bomb is refused too). Other content encodings get 415; an API write whose
    Content-Type is not application/json gets 415 too (a cross-site form can only send
    text/plain, form or multipart bodies without a CORS preflight, which we never grant).

    Memory: a request holds its body and, while the route parses it, several times that;
    bodies in flight together are capped at `max_inflight_bytes` (503 + Retry-After
    beyond), and a body must arrive within `body_timeout_s` (408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_inflight_bytes: int,
                 body_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes  # at least 2 x max_bytes (Settings)
        self.body_timeout_s = body_timeout_s
        self.inflight_bytes = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in UNSAFE_METHODS or (
                scope["method"] == "PUT" and BUNDLE_UPLOAD.fullmatch(scope["path"])):
            # a bundle upload streams to disk under its own limit (server/api/bundles.py)
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").lower()
        if encoding not in ("identity", "gzip"):
            await error_response(send, 415, f"unsupported Content-Encoding {encoding!r}; use gzip")
            return
        length = headers.get(b"content-length")
        has_body = length not in (None, b"0") or b"transfer-encoding" in headers
        if scope["path"].startswith("/api/") and has_body:
            media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media_type != b"application/json":
                await error_response(send, 415, "Content-Type must be application/json")
                return
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(send, 413, self._too_large())
            return
        reservation = [0]  # bytes of this request counted in `inflight_bytes`
        try:
            await self._with_body(scope, receive, send, encoding, reservation)
        finally:
            self.inflight_bytes -= reservation[0]

    def _reserve(self, reservation: list[int], size: int) -> bool:
        """Count this request as holding `size` body bytes; False when that would take
        the requests in flight over `max_inflight_bytes`."""
        extra = size - reservation[0]
        if extra > 0 and self.inflight_bytes + extra > self.max_inflight_bytes:
            return False
        self.inflight_bytes += extra
        reservation[0] += extra
        return True

    async def _with_body(self, scope: Scope, receive: Receive, send: Send, encoding: str,
                         reservation: list[int]) -> None:
        body = bytearray()
        more = True
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.max_bytes:
                        await error_response(send, 413, self._too_large())
                        return
                    if not self._reserve(reservation, len(body)):
                        await _busy(send)
                        return
        except TimeoutError:
            await error_response(send, 408, f"the request body did not arrive within "
                         f"{self.body_timeout_s:g} s")
            return
        if encoding == "gzip":
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                inflated = inflater.decompress(bytes(body), self.max_bytes + 1)
            except zlib.error as exc:
                await error_response(send, 400, f"body is not valid gzip: {exc}")
                return
            if len(inflated) > self.max_bytes or inflater.unconsumed_tail:
                await error_response(send, 413, self._too_large() + " after gzip decompression")
                return
            if not self._reserve(reservation, len(body) + len(inflated)):
                await _busy(send)
                return
            body = inflated
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"]
                if k not in (b"content-encoding", b"content-length")
            ] + [(b"content-length", str(len(body)).encode())]

        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body over the limit of {self.max_bytes} bytes (AMPWATCH_MAX_BODY_BYTES)"


class QueryTextMiddleware:
    """Refuses (422) a query string with a NUL in any parameter's name or value, on
    every route at once: Postgres text cannot hold NUL, and a filter that reached the
    database with one was answered 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string", b"") if scope["type"] == "http" else b""
        if b"%00" in query:
            names = [name for name, value in parse_qsl(query.decode("latin-1"),
                                                       keep_blank_values=True)
                     if "\x00" in name or "\x00" in value]
            if names:
                await error_response(send, 422, [
                    {"loc": ["query", name.replace("\x00", "")[:100]],
                     "msg": "must not contain a NUL character", "type": "value_error"}
                    for name in names[:10]])
                return
        await self.app(scope, receive, send)


class SecurityHeadersMiddleware:
    """Outermost layer: adds SECURITY_HEADERS to every response, errors of the other
    layers included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _busy(send: Send) -> None:
    await error_response(send, 503, "the server is busy with other large requests "
                 "(AMPWATCH_MAX_INFLIGHT_BODY_BYTES); retry", retry_after=1)


async def error_response(send: Send, status: int, detail: str | list[dict],
                         retry_after: int | None = None,
                         extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer `{"detail": detail}` with `status`, from middleware (no route ran)."""
    payload = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), *(extra or [])]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class SameOriginPolicyMiddleware:
    """Adds a Content-Security-Policy that allows only this server (plus inline code,
    data: images and blob: workers, which Swagger UI and ReDoc use) to the responses of
    `paths`. The bundled ReDoc hard-codes a logo from cdn.redoc.ly: with this policy the
    browser never requests it, so /docs and /redoc send nothing outside, air-gapped or not."""

    POLICY = (b"default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
              b"script-src 'self' 'unsafe-inline'; worker-src 'self' blob:; "
              b"font-src 'self' data:; connect-src 'self'")

    def __init__(self, app: ASGIApp, paths: tuple[str, ...]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return

        async def send_with_policy(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"content-security-policy", self.POLICY))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_policy)
