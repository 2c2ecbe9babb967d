"""Pure ASGI middleware: request body size limit and gzip request bodies."""

from __future__ import annotations

import json
import zlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestBodyMiddleware:
    """Rejects bodies over `max_bytes` (413) before any route runs, and inflates
    `Content-Encoding: gzip` bodies (the limit applies after inflation, so a small
    gzip bomb is refused too). Other content encodings get 415."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").lower()
        if encoding not in ("identity", "gzip"):
            await _error(send, 415, f"unsupported Content-Encoding {encoding!r}; use gzip")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _error(send, 413, self._too_large())
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await _error(send, 413, self._too_large())
                return
        if encoding == "gzip":
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                inflated = inflater.decompress(bytes(body), self.max_bytes + 1)
            except zlib.error as exc:
                await _error(send, 400, f"body is not valid gzip: {exc}")
                return
            if len(inflated) > self.max_bytes or inflater.unconsumed_tail:
                await _error(send, 413, self._too_large() + " after gzip decompression")
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


async def _error(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode())],
    })
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
