"""How `ampwatch serve` runs uvicorn: connection limits and timeouts that keep slow,
idle or non-reading clients from holding the server (a reverse proxy in front should add
its own)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import struct

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import fcntl
    import termios
except ImportError:  # Windows: only this process's share of the unsent bytes is seen
    fcntl = termios = None  # type: ignore[assignment]

MAX_HEADER_BYTES = 64 * 1024  # h11's limit on an incomplete request head
KEEP_ALIVE_S = 5
# what a client must take each send_timeout_s to keep a paused response going; a client
# that reads nothing still lets its kernel take a few KiB now and then
MIN_SEND_PROGRESS_BYTES = 64 * 1024
# SO_LINGER on with 0 s: close() resets the connection and drops the kernel's unsent bytes
LINGER_RESET = struct.pack("ii", 1, 0)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus three guards against clients that hold connections:
    - a connection that has not sent a whole request head within `header_timeout_s` of
      connecting (or of its first byte after a keep-alive pause) is closed;
    - a response whose client takes less than `MIN_SEND_PROGRESS_BYTES` of it in
      `send_timeout_s` while writing is paused is abandoned: the connection is reset, which
      frees the unsent bytes held in this process and in the kernel, and ends a request
      still streaming (its slot freed). A response sent in one write (JSON answers) gave
      its slot back when it was written. A slow but steady reader gets its whole answer;
    - at the connection limit, a new connection closes the oldest idle ones (no request
      in progress), so idle connections cannot shut out the next request, /health included.
    """

    header_timeout_s = 15.0
    send_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._connected_at = self.loop.time()
        self._arm_head_timer()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_head_timer()  # part of a head is waiting
        elif self.conn.their_state is not h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _arm_send_timer(self) -> None:
        self._unsent_at_arming = self._unsent()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_late)

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client: this process's buffer plus the
        kernel's send queue (up to 4 MiB, which a slow reader may take longer than
        `send_timeout_s` to empty). Two cheap calls, one an ioctl."""
        return self.transport.get_write_buffer_size() + kernel_unsent_bytes(
            self.transport.get_extra_info("socket"))

    def _send_late(self) -> None:
        self._send_timer = None
        if not self.flow.write_paused:
            return
        if self._unsent() <= self._unsent_at_arming - MIN_SEND_PROGRESS_BYTES:
            self._arm_send_timer()  # a slow reader, not a stuck one
            return
        # close() would wait for the client to read the buffer: it never will; a plain
        # abort would leave the kernel's send queue (up to 4 MiB) to an orphan for minutes
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
        self.transport.abort()

    def is_idle(self) -> bool:
        """No request in progress: waiting for (the rest of) a request head."""
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete)

    def _make_room(self) -> None:
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        idle = sorted((c for c in self.connections
                       if c is not self and isinstance(c, HeaderTimeoutProtocol)
                       and c.is_idle() and not c.transport.is_closing()),
                      key=lambda c: c._connected_at)
        for victim in idle[:len(self.connections) - limit + 1]:
            victim.transport.abort()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def kernel_unsent_bytes(sock: socket.socket | None) -> int:
    """Bytes in `sock`'s kernel send queue that the peer has not acknowledged (Linux's
    SIOCOUTQ); 0 where the platform does not tell."""
    if sock is None or fcntl is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
    except (OSError, AttributeError, ValueError):
        return 0


MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process (True when set). Each thread that
    allocates gets an arena of its own, up to 8 per core, and a freed request's memory
    stays in its thread's arena: after large requests on many pool threads the resident
    set held the sum (docs/benchmarks.md). Python threads share the GIL, so fewer arenas
    cost no parallelism. No-op off glibc."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def uvicorn_options(header_timeout_s: float, send_timeout_s: float, max_connections: int
                    ) -> dict:
    """Keyword arguments for `uvicorn.run`."""
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                    {"header_timeout_s": header_timeout_s, "send_timeout_s": send_timeout_s})
    return {
        "http": protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "limit_concurrency": max_connections,
    }


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), bound before anything else starts, so that a
    port in use is told at once and nothing (no database file) is made. OSError as
    `socket.bind` raises it (errno EADDRINUSE: the port is in use)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        listener.bind(address)
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener
