"""Cross-site writes, security headers, and the caps that keep one client from taking the
server: requests in flight, body bytes in flight, slow headers and bodies. /health stays
reachable throughout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from pydantic import SecretStr

from ampwatch.server.app import close_app, create_app
from tests.conftest import LiveServer, judged_client
from tests.utils import make_layers, make_steps, register_run

TOKEN = "s3cret-token"
JSON = {"content-type": "application/json"}


@pytest.fixture
def token_api(settings):
    app = create_app(settings.model_copy(update={"token": SecretStr(TOKEN)}))
    with judged_client(app) as client:
        yield client
    close_app(app)


def stored_steps(api, run_id: str = "r1") -> int:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return api.get(f"/api/v1/runs/{run_id}", headers=headers).json()["steps"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_writes_need_a_json_content_type(api, content_type):
    register_run(api, "r1")
    body = json.dumps({"rank": 0, "seq": 0, "steps": make_steps(0, 2, 4)})
    headers = {"content-type": content_type} if content_type else {}
    response = api.post("/api/v1/runs/r1/batches", content=body, headers=headers)
    assert response.status_code == 415 and "application/json" in response.text
    assert api.put("/api/v1/runs/r2", content='{"name": "x"}', headers=headers
                   ).status_code == 415
    assert stored_steps(api) == 0 and api.get("/api/v1/runs/r2").status_code == 404
    ok = api.post("/api/v1/runs/r1/batches", content=body,
                  headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_cookie_writes_need_this_sites_origin(token_api):
    api = token_api
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    api.put("/api/v1/runs/r1", json={"name": "r1"}, headers=bearer).raise_for_status()
    api.cookies.set("ampwatch_token", TOKEN)
    batch = {"rank": 0, "seq": 0, "steps": [{"step": 0}, {"step": 1}]}
    no_origin = api.post("/api/v1/runs/r1/batches", json=batch)
    assert no_origin.status_code == 403 and "Origin" in no_origin.json()["detail"]
    other_site = api.post("/api/v1/runs/r1/batches", json=batch,
                          headers={"Origin": "http://evil.example:8001"})
    assert other_site.status_code == 403
    assert api.delete("/api/v1/runs/r1", headers={"Origin": "http://localhost:8001"}
                      ).status_code == 403
    assert stored_steps(api) == 0
    same_site = api.post("/api/v1/runs/r1/batches", json=batch,
                         headers={"Origin": "http://testserver"})
    assert same_site.status_code == 200
    api.cookies.clear()
    assert api.post("/api/v1/runs/r1/batches", json={**batch, "seq": 1},
                    headers=bearer).status_code == 200  # the agent: no Origin, a bearer


def test_security_headers_on_api_pages_and_errors(api):
    for path in ("/api/v1/health", "/api/v1/runs", "/api/v1/runs/nope", "/", "/login"):
        headers = api.get(path).headers
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["referrer-policy"] == "same-origin", path


def test_the_login_pages_first_button_logs_in(token_api):
    html = token_api.get("/login").text
    assert html.index("<button") == html.index('<button type="submit">Log in')
    token_api.cookies.set("ampwatch_token", TOKEN)
    assert "Log out" not in token_api.get("/login").text
    assert "Log out" in token_api.get("/").text


def open_slow_request(server: LiveServer, path: str, declared: int, sent: bytes
                      ) -> socket.socket:
    """A request whose body is still arriving: it stays in flight until closed."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
    return sock


def read_reply(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """The response head (what arrived until the connection closed or went quiet)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def limited_server(tmp_path):
    server = LiveServer(f"sqlite:///{tmp_path / 'limits.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_CONCURRENT_REQUESTS": "3", "AMPWATCH_BODY_TIMEOUT_S": "2",
        "AMPWATCH_HEADER_TIMEOUT_S": "2", "AMPWATCH_MAX_BODY_BYTES": "4096",
        "AMPWATCH_MAX_INFLIGHT_BODY_BYTES": "8192"})
    server.start()
    yield server
    server.stop()


def test_body_bytes_in_flight_are_capped(limited_server):
    """Two requests holding 4,090 body bytes each fill the 8,192-byte budget: a third
    body is answered 503 (busy) while they are held, and taken once they are gone. (The
    request cap itself: tests/server/test_hostile_clients.py.)"""
    server = limited_server
    run = {"name": "r1", "layers": make_layers(2)}
    body = json.dumps(run).encode()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        held = [open_slow_request(server, "/api/v1/runs/r1", 4096, b" " * 4090)
                for _ in range(2)]
        # the held bytes reach the server in their own time on a loaded machine: ask
        # until it answers busy, bounded in time
        deadline = time.monotonic() + 20
        answer = http.put("/api/v1/runs/r1", content=body, headers=JSON)
        while answer.status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = http.put("/api/v1/runs/r1", content=body, headers=JSON)
        assert answer.status_code == 503 and "busy" in answer.json()["detail"]
        assert answer.headers["retry-after"] == "1"
        assert http.get("/api/v1/health").status_code == 200
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while answer.status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = http.put("/api/v1/runs/r1", content=body, headers=JSON)
        assert answer.status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_408(limited_server):
    sock = open_slow_request(limited_server, "/api/v1/runs/r1/batches", 100, b'{"rank"')
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_slow_header_connection_is_closed(limited_server):
    sock = socket.create_connection(("127.0.0.1", limited_server.port))
    sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    started = time.monotonic()
    sock.settimeout(10)
    assert sock.recv(1024) == b""  # closed without an answer
    assert time.monotonic() - started < 8
    sock.close()


def test_an_inflight_budget_below_two_bodies_is_refused_at_start():
    from pydantic import ValidationError

    from ampwatch.server.settings import Settings

    with pytest.raises(ValidationError, match="at least twice max_body_bytes"):
        Settings(max_body_bytes=8 * 1024 * 1024, max_inflight_body_bytes=10 * 1024 * 1024)
    assert Settings().max_inflight_body_bytes >= 2 * Settings().max_body_bytes
