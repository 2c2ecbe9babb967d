"""How `ampwatch serve` runs uvicorn: connection limits and timeouts that keep slow or
idle clients from holding the server (a reverse proxy in front should add its own)."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 64 * 1024  # h11's limit on an incomplete request head
KEEP_ALIVE_S = 5


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection that has not sent a whole request head
    within `header_timeout_s` of connecting (or of its first byte after a keep-alive
    pause) is closed. Without it, a thousand connections sending one header byte a
    minute hold file descriptors until /api/v1/health cannot be reached."""

    header_timeout_s = 15.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_head_timer()  # part of a head is waiting
        elif self.conn.their_state is not h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(header_timeout_s: float, max_connections: int) -> dict:
    """Keyword arguments for `uvicorn.run`."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                    {"header_timeout_s": header_timeout_s})
    return {
        "http": protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "limit_concurrency": max_connections,
    }
