"""Clients that try to take the server from outside, against a live server on loopback:
request slots held by clients without the token or by clients that never read, foreign
Host names (DNS rebinding), and idle connections. Request loops are bounded in count and
time."""

from __future__ import annotations

import contextlib
import json
import math
import re
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.utils import make_layers, make_steps, register_run

TOKEN = "hostile-s3cret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SLOTS = 3  # requests in flight; a small cap, so few hostile connections would fill it
SEND_TIMEOUT_S = 3


def start_server(tmp_path, **env: str) -> LiveServer:
    server = LiveServer(f"sqlite:///{tmp_path / 'hostile.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_CONCURRENT_REQUESTS": str(SLOTS), "AMPWATCH_BODY_TIMEOUT_S": "30",
        "AMPWATCH_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S), **env})
    server.start()
    return server


@pytest.fixture
def token_server(tmp_path) -> Iterator[LiveServer]:
    server = start_server(tmp_path, AMPWATCH_TOKEN=TOKEN)
    yield server
    server.stop()


@pytest.fixture
def open_server(tmp_path) -> Iterator[LiveServer]:
    server = start_server(tmp_path)
    yield server
    server.stop()


# plotly.js (1.5 MB, the cartesian bundle) asked for four times on one connection: more
# than the kernel's buffers hold, so a client that reads none of it blocks the server's send
STATIC = "/static/plotly.min.js"
STATIC_TIMES = 4


def non_reader(server: LiveServer, path: str, headers: str = "", times: int = 1
               ) -> socket.socket:
    """A connection that asks for `path` (`times` requests, pipelined) and never reads (a
    4 KiB receive buffer): the server's send blocks as soon as the kernel's buffers are
    full."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode() * times)
    return sock


def slow_body(server: LiveServer, path: str, headers: str = "") -> socket.socket:
    """A POST whose 1,000-byte body has sent one byte: it is still arriving."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 f"\r\nContent-Length: 1000\r\n{headers}\r\n{{".encode())
    return sock


@contextmanager
def held(sockets: list[socket.socket]) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        for sock in sockets:
            stack.callback(sock.close)
        time.sleep(0.5)  # let the server take them in
        yield sockets


def reset_by_server(sock: socket.socket) -> bool:
    """Whether the server has reset the connection, seen without reading from it (a client
    that read would take the answer and end the test's premise): a reset closes the socket
    both ways (POLLHUP), where the server's orderly close would end only its reading side."""
    poll = select.poll()
    poll.register(sock, select.POLLHUP)
    return any(events & select.POLLHUP for _, events in poll.poll(0))


def test_clients_that_never_read_static_files_take_no_slot(token_server):
    server = token_server
    with (held([non_reader(server, STATIC, times=STATIC_TIMES)
                 for _ in range(SLOTS * 2)]),
          httpx.Client(base_url=server.url, headers=BEARER, timeout=10) as http):
        for _ in range(3):
            assert http.get("/api/v1/runs").status_code == 200
            assert http.get("/").status_code == 200


def test_clients_without_the_token_take_no_slot(token_server):
    server = token_server
    sockets = [slow_body(server, "/api/v1/runs/r1/batches") for _ in range(SLOTS * 2)]
    with held(sockets):
        with httpx.Client(base_url=server.url, headers=BEARER, timeout=10) as http:
            assert http.get("/api/v1/runs").status_code == 200
        # refused at once, before their bodies arrive
        for sock in sockets:
            sock.settimeout(5)
            assert sock.recv(1024).startswith(b"HTTP/1.1 401"), "no prompt 401"


def test_bodies_still_arriving_take_no_slot(open_server):
    server = open_server
    with (held([slow_body(server, "/api/v1/runs/r1/batches") for _ in range(SLOTS * 2)]),
          httpx.Client(base_url=server.url, timeout=10) as http):
        assert http.get("/api/v1/runs").status_code == 200
        http.put("/api/v1/runs/r2", json={"name": "r2"}).raise_for_status()


BUNDLE_TIMEOUT_S = 3


def test_trickled_bundle_uploads_take_no_slot_and_are_cut_at_the_deadline(tmp_path):
    """Twice as many bundle uploads as slots, each sending `PK` and then a byte every
    half second (no chunk is late, so a timeout per chunk never fires): the token's other
    requests answer 200 promptly, and each upload is cut (408) at the whole body's
    deadline. The route streamed the body inside its slot: every request got 503."""
    server = start_server(tmp_path, AMPWATCH_TOKEN=TOKEN,
                          AMPWATCH_BUNDLE_TIMEOUT_S=str(BUNDLE_TIMEOUT_S))
    try:
        with httpx.Client(base_url=server.url, headers=BEARER, timeout=10) as http:
            register_run(http, "slow-bundles")
            sockets = []
            for _ in range(SLOTS * 2):
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(b"PUT /api/v1/runs/slow-bundles/bundles/0/8 HTTP/1.1\r\n"
                             b"Host: 127.0.0.1\r\nContent-Type: application/zip\r\n"
                             b"Content-Length: 100000\r\n"
                             + f"Authorization: Bearer {TOKEN}\r\n\r\nPK".encode())
                sockets.append(sock)
            with held(sockets):
                began = time.monotonic()
                while time.monotonic() - began < BUNDLE_TIMEOUT_S + 2:
                    for sock in sockets:
                        with contextlib.suppress(OSError):  # cut off: the server closed it
                            sock.sendall(b"\x00")
                    asked = time.monotonic()
                    assert http.get("/api/v1/runs").status_code == 200
                    assert time.monotonic() - asked < 2, "an API request waited for a slot"
                    time.sleep(0.5)
                for sock in sockets:
                    sock.settimeout(5)
                    assert sock.recv(1024).startswith(b"HTTP/1.1 408"), "not cut at the deadline"
            assert http.get("/api/v1/runs/slow-bundles/bundles").json()["items"] == []
    finally:
        server.stop()


STEPS = "/api/v1/runs/long/steps?limit=100000"  # the whole run, in one write
STEP_BYTES = 487  # one step's record in that answer


def kernel_send_buffer_max() -> int:
    """The most a TCP socket's kernel send queue grows to (Linux's tcp_wmem; 4 MiB
    elsewhere and by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024


@pytest.fixture(scope="module")
def long_server(tmp_path_factory) -> Iterator[LiveServer]:
    """A token server holding a run whose step records outsize what the kernel buffers
    for a client (7.3 MB of JSON at tcp_wmem's default 4 MiB): the rest of an answer its
    client does not read waits in the server, which pauses writing."""
    server = start_server(tmp_path_factory.mktemp("long"), AMPWATCH_TOKEN=TOKEN)
    batches = math.ceil((kernel_send_buffer_max() + 2_700_000) / STEP_BYTES / 5000)
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=60) as http:
        http.put("/api/v1/runs/long", json={"name": "long", "layers": make_layers(1)}
                 ).raise_for_status()
        for seq in range(batches):
            http.post("/api/v1/runs/long/batches", json={
                "rank": 0, "seq": seq, "steps": make_steps(seq * 5000, 5000, 1)}
                      ).raise_for_status()
    yield server
    server.stop()


def answer_begun(stack: ExitStack, server: LiveServer, path: str, headers: str = "",
                 times: int = 1) -> tuple[socket.socket, float]:
    """A non-reader whose 200 answer has begun (closed with `stack`), and when it asked.
    A slot stays held for a moment after its answer is written (its database session
    closes then), so a request right after another may get a 503: that answer is whole,
    and the client asks again."""
    for _ in range(50):
        asked = time.monotonic()
        sock = stack.enter_context(non_reader(server, path, headers, times))
        sock.settimeout(30)
        head = sock.recv(12, socket.MSG_PEEK)
        if head != b"HTTP/1.1 503":
            assert head == b"HTTP/1.1 200", head
            return sock, asked
        sock.close()
        time.sleep(0.1)
    raise AssertionError(f"{path}: 503 for 5 s")


def test_responses_nobody_reads_hold_no_slot_and_are_reset(long_server):
    """A JSON answer is handed to the connection in one write, so its slot is free once
    it is written, read or not: more clients than slots that never read a large answer
    leave the token's holders answered. After AMPWATCH_SEND_TIMEOUT_S in which a client
    took nothing, the server resets its connection, which drops the unsent answer from
    its own buffers and from the kernel's (a plain close would leave the kernel's few MiB
    to an orphan socket for as long as the client stays)."""
    server = long_server
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    steps: list[tuple[socket.socket, float]] = []  # each with when it asked
    static: list[tuple[socket.socket, float]] = []
    held_during_200 = []  # unread step answers not yet reset when /runs answered 200
    with ExitStack() as stack, httpx.Client(base_url=server.url, headers=BEARER,
                                            timeout=30) as http:
        for _ in range(3):
            steps += [answer_begun(stack, server, STEPS, auth) for _ in range(SLOTS)]
            static.append(answer_begun(stack, server, STATIC, times=STATIC_TIMES))
            assert http.get("/api/v1/runs").status_code == 200
            held_during_200.append(sum(not reset_by_server(sock) for sock, _ in steps))
        assert max(held_during_200) >= SLOTS, (
            f"too slow to tell: answers were reset before /runs was asked {held_during_200}")

        stuck = steps + static
        reset_after = [math.inf] * len(stuck)
        deadline = time.monotonic() + SEND_TIMEOUT_S + 15
        while math.inf in reset_after and time.monotonic() < deadline:
            for i, (sock, asked) in enumerate(stuck):
                if reset_after[i] == math.inf and reset_by_server(sock):
                    reset_after[i] = time.monotonic() - asked
            time.sleep(0.05)
        print(f"{len(stuck)} unread answers (7.3 MB of steps, plotly.min.js): reset "
              f"{min(reset_after):.1f}-{max(reset_after):.1f} s after their requests "
              f"(send timeout {SEND_TIMEOUT_S} s); at most {max(held_during_200)} at "
              f"once with {SLOTS} slots")
        assert min(reset_after) >= SEND_TIMEOUT_S and max(reset_after) < SEND_TIMEOUT_S + 15
        assert http.get("/api/v1/runs").status_code == 200


def test_a_slow_reader_gets_its_whole_answer(long_server):
    """A client that reads steadily, at 1 MB/s, for longer than the send timeout is not
    cut off: the timeout is for a client that takes nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 * 1024)
    with sock:
        sock.connect(("127.0.0.1", long_server.port))
        sock.sendall(f"GET {STEPS} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
        sock.settimeout(30)
        started = time.monotonic()
        answer = bytearray()
        length = math.inf
        while len(answer) < length:
            chunk = sock.recv(128 * 1024)
            assert chunk, f"cut off after {len(answer)} bytes of {length}"
            answer += chunk
            if (head := re.match(rb"(.*?content-length: (\d+).*?\r\n\r\n)", answer, re.S)):
                length = len(head[1]) + int(head[2])
            time.sleep(0.125)
        took = time.monotonic() - started
    print(f"a 1 MB/s reader took its {len(answer) / 1e6:.1f} MB answer whole in {took:.1f} s")
    assert took > SEND_TIMEOUT_S + 1, "the answer was read too fast to tell"


def test_anonymous_requests_of_one_client_are_capped(token_server):
    """Without the token, one address holds at most AMPWATCH_MAX_REQUESTS_PER_CLIENT
    requests (static files, the login page) and never an API slot."""
    server = token_server
    limit = 4
    server.stop()
    server.env["AMPWATCH_MAX_REQUESTS_PER_CLIENT"] = str(limit)
    server.start()
    with (held([slow_body(server, "/login") for _ in range(limit)]),
          httpx.Client(base_url=server.url, timeout=10) as http):
        assert http.get("/login").status_code == 503
        assert http.get("/api/v1/runs", headers=BEARER).status_code == 200
        assert http.get("/api/v1/health").status_code == 200


# DNS rebinding: a page on rebind.example whose name now resolves to 127.0.0.1 sends
# same-origin requests with that Host (and Origin): a server without a token must refuse.
FOREIGN = "rebind.example"


def test_a_foreign_host_is_refused_without_a_token(open_server):
    server = open_server
    foreign = f"{FOREIGN}:{server.port}"
    with httpx.Client(base_url=server.url, timeout=10) as http:
        http.put("/api/v1/runs/victim", json={"name": "victim"}).raise_for_status()
        gone = http.delete("/api/v1/runs/victim",
                           headers={"Host": foreign, "Origin": f"http://{foreign}"})
        assert gone.status_code == 400 and "Host" in gone.json()["detail"]
        assert http.get("/api/v1/runs", headers={"Host": foreign}).status_code == 400
        assert http.get("/", headers={"Host": foreign}).status_code == 400
        assert http.get("/api/v1/runs/victim").status_code == 200
        for name in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST."):
            assert http.get("/api/v1/runs", headers={"Host": f"{name}:{server.port}"}
                            ).status_code == 200, name


def test_the_public_urls_host_and_allowed_hosts_are_trusted(tmp_path):
    server = start_server(tmp_path, AMPWATCH_ALERTS__PUBLIC_URL="https://watch.example/",
                          AMPWATCH_ALLOWED_HOSTS="gpu-box,10.0.0.7")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for host in ("watch.example", "gpu-box:8000", "10.0.0.7"):
                assert http.get("/api/v1/runs", headers={"Host": host}).status_code == 200
            assert http.get("/api/v1/runs", headers={"Host": FOREIGN}).status_code == 400
    finally:
        server.stop()


def test_any_host_is_answered_with_a_token(token_server):
    """With a token a rebinding page gains nothing (it has no token, and the login cookie
    belongs to the real name), and a server behind a proxy sees many names."""
    with httpx.Client(base_url=token_server.url, headers=BEARER, timeout=10) as http:
        assert http.get("/api/v1/runs", headers={"Host": FOREIGN}).status_code == 200


def test_idle_connections_do_not_shut_out_requests(open_server):
    """Connections that send nothing are dropped, oldest first, when new ones need room."""
    server = open_server
    limit = SLOTS * 8 + 64  # `ampwatch serve`'s connection limit
    with ExitStack() as stack:
        for _ in range(limit + 40):
            sock = socket.create_connection(("127.0.0.1", server.port))
            stack.callback(sock.close)
        time.sleep(0.5)
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert http.get("/api/v1/health").status_code == 200
            assert http.get("/api/v1/runs").status_code == 200


def _near_cap_batch() -> bytes:
    return json.dumps({"rank": 0, "seq": 0, "steps": make_steps(0, 6000, 1000)}).encode()


def _near_cap_layer_table() -> bytes:
    """100,000 layers with long names (about 52 MB), the last one nameless."""
    layers = make_layers(100_000)
    for layer in layers:
        layer["name"] = f"{'encoder.' * 40}{layer['index']}"
    layers[-1]["name"] = ""
    return json.dumps({"layers": layers}).encode()


@pytest.mark.parametrize(("method", "path", "make_body", "status"), [
    ("POST", "/api/v1/runs/nope/batches", _near_cap_batch, 404),  # parsed whole: no such run
    ("PUT", "/api/v1/runs/big", _near_cap_layer_table, 422),  # parsed whole: last layer refused
], ids=["batch", "run"])
def test_a_large_body_is_parsed_off_the_event_loop(open_server, method, path, make_body,
                                                   status):
    """While a near-cap body (under the 64 MiB cap) is parsed, /health keeps answering: it
    once waited for the whole parse (4.4 s for a 3.6 MB invalid batch)."""
    server = open_server
    body = make_body()
    with httpx.Client(base_url=server.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        post = pool.submit(http.request, method, path, content=body,
                           headers={"content-type": "application/json"})
        slowest = 0.0
        while not post.done():
            asked = time.monotonic()
            assert http.get("/api/v1/health").status_code == 200
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.02)
        took = time.monotonic() - started
        assert post.result().status_code == status
    print(f"/health during a {len(body) / 1e6:.0f} MB parse: slowest {slowest:.2f} s of the "
          f"request's {took:.2f} s")
    assert took > 0.3, "the parse was too quick to tell"
    assert slowest < 0.5 * took, f"/health took {slowest:.2f} s of the request's {took:.2f} s"
