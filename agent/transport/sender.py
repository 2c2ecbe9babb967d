"""HTTP to the server: register a run, post a batch. Worker thread only; may block up to
the given timeout. Responses are classified so the worker knows whether to retry, and a
request that got no answer says why (`Response.error`)."""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from enum import Enum
from typing import Any

import httpx


class Outcome(Enum):
    OK = "ok"            # committed (or acknowledged duplicate)
    RETRY = "retry"      # unreachable, 5xx, 408, 429: keep it, back off
    MISSING = "missing"  # 404: the run is not registered there (yet)
    CONFLICT = "conflict"  # 409: the seq is taken by other steps; renumber and resend
    UNAUTHORIZED = "unauthorized"  # 401/403: no or wrong token; keep it for `sync --token`
    REJECT = "reject"    # any other 4xx: sending it again cannot succeed


# the longest Retry-After honoured: a server's mistake must not silence an agent for hours
MAX_RETRY_AFTER_S = 300.0


@dataclass
class Response:
    outcome: Outcome
    body: Any = None
    status: int | None = None
    retry_after: float | None = None  # seconds the server asked to wait (Retry-After)
    # no answer came: why ("connection refused", ...); None for a timeout shorter than
    # the full one (the caller's deadline, not the server's fault)
    error: str | None = None


def retry_after_s(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), at most
    MAX_RETRY_AFTER_S; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            moment = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if moment.tzinfo is None:  # "-0000": UTC, RFC 5322 says
            moment = moment.replace(tzinfo=UTC)
        seconds = moment.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def failure(exc: BaseException, timeout: httpx.Timeout) -> str:
    """Why a request got no answer, in a few words, from the exception's chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"its TLS certificate was not accepted ({seen.verify_message})"
        if isinstance(seen, ssl.SSLError):
            return "the TLS handshake failed: is it a plain http:// server?"
        if isinstance(seen, socket.gaierror):
            return "its host name does not resolve"
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused: nothing listens on that port"
        if isinstance(seen, httpx.ConnectTimeout):
            return f"no connection within {timeout.connect:g} s"
        if isinstance(seen, httpx.TimeoutException | TimeoutError):
            return f"no answer within {timeout.read:g} s"
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, httpx.RemoteProtocolError):
        return "it closed the connection without an answer"
    return f"{type(exc).__name__}: {exc}"


def classify(status: int) -> Outcome:
    if 200 <= status < 300:
        return Outcome.OK
    if status >= 500 or status in (408, 425, 429):
        return Outcome.RETRY
    if status == 404:
        return Outcome.MISSING
    if status == 409:
        return Outcome.CONFLICT
    if status in (401, 403):
        return Outcome.UNAUTHORIZED
    return Outcome.REJECT


class Sender:
    """Keep-alive HTTP client for one server; `token` (when not empty) is sent as
    `Authorization: Bearer <token>`, as the server's AMPWATCH_TOKEN wants."""

    CONNECT_TIMEOUT_S = 2.0
    REQUEST_TIMEOUT_S = 10.0

    def __init__(self, base_url: str, token: str | None = None) -> None:
        headers = {"User-Agent": "ampwatch-agent"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=base_url, headers=headers)
        # sees every response, on the thread that sent it (delivery.py watches outages)
        self.on_reply: Callable[[Response], None] = lambda reply: None

    def _request(self, method: str, url: str, timeout: httpx.Timeout, **kwargs: Any
                 ) -> Response:
        """One request, classified; a transport failure is a RETRY with its `error`."""
        try:
            reply = self._client.request(method, url, timeout=timeout, **kwargs)
        except httpx.TimeoutException as exc:
            # a wait cut short by the caller (a flush's deadline, the heartbeat) says
            # nothing about the server: only the full timeout is a verdict
            full = (timeout.read or 0.0) >= self.REQUEST_TIMEOUT_S and (
                timeout.connect or 0.0) >= self.CONNECT_TIMEOUT_S
            response = Response(Outcome.RETRY, error=failure(exc, timeout) if full else None)
        except httpx.HTTPError as exc:
            response = Response(Outcome.RETRY, error=failure(exc, timeout))
        else:
            try:
                parsed = reply.json()
            except ValueError:
                parsed = None
            response = Response(classify(reply.status_code), parsed, reply.status_code,
                                retry_after_s(reply.headers.get("retry-after")))
        self.on_reply(response)
        return response

    def _timeout(self, limit: float | None) -> httpx.Timeout:
        total = self.REQUEST_TIMEOUT_S if limit is None else max(0.05, min(
            limit, self.REQUEST_TIMEOUT_S))
        return httpx.Timeout(total, connect=min(total, self.CONNECT_TIMEOUT_S))

    def _send(self, method: str, url: str, body: dict | bytes, limit: float | None,
              compress: bool) -> Response:
        content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=False).encode()
        headers = {"Content-Type": "application/json"}
        if compress:
            content = gzip.compress(content, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        return self._request(method, url, self._timeout(limit), content=content,
                             headers=headers)

    def put_run(self, run_id: str, body: dict, limit: float | None = None) -> Response:
        return self._send("PUT", f"/api/v1/runs/{run_id}", body, limit, compress=False)

    def post_batch(self, run_id: str, batch: dict | bytes, limit: float | None = None
                   ) -> Response:
        """POST a batch: a dict, or its JSON already encoded (bytes)."""
        return self._send("POST", f"/api/v1/runs/{run_id}/batches", batch, limit, compress=True)

    def post_reached(self, run_id: str, rank: int, step: int, limit: float | None = None
                     ) -> Response:
        """POST the heartbeat: the last step the training loop closed."""
        return self._send("POST", f"/api/v1/runs/{run_id}/ranks/{rank}/reached",
                          {"reached_step": step}, limit, compress=False)

    def get_json(self, url: str, limit: float | None = None) -> Response:
        """GET a JSON resource of the API (the mirror reads its run's incidents)."""
        return self._request("GET", url, self._timeout(limit))

    def put_bundle(self, run_id: str, rank: int, step: int, path: Any) -> Response:
        """PUT a flight-recorder bundle file, streamed from disk (a minute per 64 MiB at
        the slowest before it counts as failed)."""
        size = path.stat().st_size
        timeout = httpx.Timeout(max(self.REQUEST_TIMEOUT_S, 60.0 * (1 + size / (64 << 20))),
                                connect=self.CONNECT_TIMEOUT_S)
        try:
            with open(path, "rb") as body:
                return self._request("PUT", f"/api/v1/runs/{run_id}/bundles/{rank}/{step}",
                                     timeout, content=body,
                                     headers={"Content-Type": "application/zip"})
        except OSError:  # reading the file: no fault of the server's
            return Response(Outcome.RETRY)

    def close(self) -> None:
        self._client.close()
