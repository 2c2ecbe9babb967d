"""Who may hold what, as pure ASGI middleware: the trusted-Host check and cross-site write
refusal (`SiteGuardMiddleware`), the token checked before a request holds anything, with a
per-client cap on requests that carry no token (`AdmissionMiddleware`), and the request
slots that only the token's holders take, once their body has arrived, waiting their turn
when all are taken (`RequestSlotMiddleware`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
from collections import Counter, deque
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from ampwatch.server.http.middleware import HEALTH_PATH, UNSAFE_METHODS, error_response
from ampwatch.server.settings import Settings

LOGIN_COOKIE = "ampwatch_token"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# answered without the token, so they never take a request slot
ANONYMOUS_PATHS = ("/static/", "/login", "/logout")
# answered 401 without the token (pages, /docs and /redoc among them, send it to /login)
TOKEN_PATHS = ("/api/", "/openapi.json")
ANONYMOUS = "ampwatch.anonymous"  # scope key: set by AdmissionMiddleware
MISSING_TOKEN = "missing or wrong token: send 'Authorization: Bearer <AMPWATCH_TOKEN>'"


def token_scheme(headers: Mapping[str, str], cookies: Mapping[str, str], token: SecretStr
                 ) -> Literal["bearer", "cookie"] | None:
    """How the request carries `token` (constant-time check), or None. A bearer header,
    right or wrong, is the only credential looked at when present."""
    expected = token.get_secret_value().encode()
    scheme, _, supplied = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return "bearer" if hmac.compare_digest(supplied.strip().encode(), expected) else None
    supplied = cookies.get(LOGIN_COOKIE, "").strip()
    return "cookie" if hmac.compare_digest(supplied.encode(), expected) else None


def host_name(host: str) -> str:
    """The name of a Host header value: no port, no IPv6 brackets, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def trusted_hosts(settings: Settings) -> frozenset[str] | None:
    """The Host names a server without a token answers to: loopback names, its bind
    address, the public URL's host and AMPWATCH_ALLOWED_HOSTS. None (any Host) with a
    token (a rebinding page has no token, and the login cookie belongs to the real name)
    or with "*" among the allowed hosts."""
    allowed = {host_name(h) for h in settings.allowed_hosts.split(",") if h.strip()}
    if settings.token is not None or "*" in allowed:
        return None
    allowed |= LOOPBACK_HOSTS
    if settings.host not in ("0.0.0.0", "::", ""):
        allowed.add(host_name(settings.host))
    if settings.alerts.public_url:
        allowed.add(host_name(urlsplit(settings.alerts.public_url).netloc))
    return frozenset(allowed)


class SiteGuardMiddleware:
    """Refuses a Host outside `hosts` (400: a DNS-rebinding page reaches a loopback server
    under its own name) and writes whose Origin is another site (403)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
                await error_response(send, 400, "the Host header names a server this one is "
                                     "not: add the name to AMPWATCH_ALLOWED_HOSTS, or set "
                                     "AMPWATCH_TOKEN")
                return
            if scope["method"] in UNSAFE_METHODS and not same_origin(scope):
                await error_response(send, 403, "cross-origin write refused: the Origin "
                                     "header names another site")
                return
        await self.app(scope, receive, send)


def same_origin(scope: Scope) -> bool:
    """True unless the request carries an Origin whose host differs from its Host header
    (scripts and forms of another site send their Origin; the agent and client send none)."""
    headers = Headers(scope=scope)
    origin = headers.get("origin")
    if origin is None:
        return True
    try:
        return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()
    except ValueError:
        return False


class AdmissionMiddleware:
    """Decides what a request may hold before it holds anything. With a token set, an API
    request without it is answered 401 at once (its body is never read). Requests that
    carry no token (static files and the login page always count as such) are anonymous:
    at most `per_client` in flight from one client address (503 beyond), and never a
    request slot. /api/v1/health is never counted."""

    def __init__(self, app: ASGIApp, token: SecretStr | None, per_client: int) -> None:
        self.app = app
        self.token = token
        self.per_client = per_client
        self.anonymous_in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        anonymous = path.startswith(ANONYMOUS_PATHS)
        if self.token is not None and not anonymous:
            headers = Headers(scope=scope)
            cookies = cookie_parser(headers.get("cookie", ""))
            anonymous = token_scheme(headers, cookies, self.token) is None
            if anonymous and path.startswith(TOKEN_PATHS):
                await error_response(send, 401, MISSING_TOKEN,
                                     extra=[(b"www-authenticate", b"Bearer")])
                return
        if not anonymous:
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown",))[0]
        if self.anonymous_in_flight[client] >= self.per_client:
            await error_response(send, 503, f"over {self.per_client} requests without the "
                                 "token in flight from this client "
                                 "(AMPWATCH_MAX_REQUESTS_PER_CLIENT); retry", retry_after=1)
            return
        self.anonymous_in_flight[client] += 1
        try:
            await self.app({**scope, ANONYMOUS: True}, receive, send)
        finally:
            self.anonymous_in_flight[client] -= 1
            if not self.anonymous_in_flight[client]:
                del self.anonymous_in_flight[client]


class RequestSlotMiddleware:
    """At most `max_requests` requests run at once; the rest wait their turn, in order of
    arrival, for up to `wait_s` each. Only a request that waited that long without a slot
    freeing is answered 503 + Retry-After: the server is behind, not merely busy (a fixed
    cap that answered the excess at once shed a 64-rank run's ordinary traffic, since a
    slot is held until the answer has left). Inside the body middleware, so a request
    takes its slot once its body has arrived: a client trickling a body holds a
    connection, not a slot. Anonymous requests (see `AdmissionMiddleware`) and
    /api/v1/health take none."""

    def __init__(self, app: ASGIApp, max_requests: int, wait_s: float) -> None:
        self.app = app
        self.max_requests = max_requests
        self.wait_s = wait_s
        self.in_flight = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH or scope.get(ANONYMOUS):
            await self.app(scope, receive, send)
            return
        if not await self._take_slot():
            await error_response(send, 503, f"no request slot freed within {self.wait_s:g} s "
                                 f"({self.max_requests} requests running, "
                                 f"{len(self.waiting)} waiting): the server is behind; retry",
                                 retry_after=math.ceil(self.wait_s))
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._give_slot()

    async def _take_slot(self) -> bool:
        """A slot now, or the next freed one within `wait_s` (False: none freed)."""
        if self.in_flight < self.max_requests and not self.waiting:
            self.in_flight += 1
            return True
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            async with asyncio.timeout(self.wait_s):
                await asyncio.shield(turn)
            return True
        except TimeoutError:
            return self._handed(turn)
        except BaseException:  # the client left: a slot handed over meanwhile goes on
            if self._handed(turn):
                self._give_slot()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self.waiting.remove(turn)

    @staticmethod
    def _handed(turn: asyncio.Future[None]) -> bool:
        """Whether a freed slot was handed to `turn` (and stop it taking one later)."""
        if turn.done():
            return True
        turn.cancel()
        return False

    def _give_slot(self) -> None:
        """Hand the slot to the longest waiter still waiting, else free it."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.in_flight -= 1
