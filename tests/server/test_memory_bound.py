"""The server's memory stays bounded under hostile load: a live server process takes many
concurrent near-cap batches, a huge config, bodies over the cap and a gzip bomb, and its
peak resident set (the kernel's high-water mark, so no sampling and no timing) stays under
a bound derived from its caps."""

from __future__ import annotations

import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ampwatch.server.budget import layers_estimate
from tests.conftest import LiveServer
from tests.utils import make_layers, make_steps

MiB = 1 << 20
BODY_CAP = 8 * MiB
INFLIGHT_CAP = 2 * BODY_CAP  # the least the server allows: two bodies in flight
# A batch costs over 10x its body while it is parsed and stored (pydantic objects, then
# numpy arrays). This load peaked 200-220 MiB above the start at these caps, and 830 MiB
# with the cap on bytes in flight raised out of the way (what the bound must catch).
PARSE_FACTOR = 20
N_LAYERS = 1000
CLIENTS = 16  # the default cap on requests in flight
GIVE_UP_S = 600


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (Linux), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def peak_rss(pid: int) -> int:
    """The process's peak resident set so far (VmHWM)."""
    return proc_status_bytes(pid, "VmHWM")


def rss(pid: int) -> int:
    return proc_status_bytes(pid, "VmRSS")


@pytest.fixture
def capped_server(tmp_path):
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the server's peak memory from /proc (Linux)")
    server = LiveServer(f"sqlite:///{tmp_path / 'memory.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_BODY_BYTES": str(BODY_CAP),
        "AMPWATCH_MAX_INFLIGHT_BODY_BYTES": str(INFLIGHT_CAP),
        "AMPWATCH_MAX_CONCURRENT_REQUESTS": str(CLIENTS),
    })
    server.start()
    yield server
    server.stop()


def near_cap_batch(seq: int) -> bytes:
    """A valid batch of one rank just under BODY_CAP (about 1,000 steps of 1,000 layers)."""
    one_step = len(json.dumps(make_steps(0, 1, N_LAYERS)[0])) + 1
    steps = make_steps(seq * 10_000, int(BODY_CAP * 0.95) // one_step, N_LAYERS)
    body = json.dumps({"rank": 0, "seq": seq, "steps": steps}).encode()
    assert 0.8 * BODY_CAP < len(body) < BODY_CAP
    return body


def send(url: str, method: str, path: str, body: bytes, headers: dict | None = None) -> int:
    """The final status, after waiting out every 503 (busy) the way the agent does; the
    generous deadline only stops a hung server (a loaded machine is slow, not wrong)."""
    headers = {"content-type": "application/json", **(headers or {})}
    deadline = time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        response = httpx.request(method, url + path, content=body, headers=headers,
                                 timeout=GIVE_UP_S)
        if response.status_code != 503:
            return response.status_code
        time.sleep(0.2)
    raise AssertionError(f"{method} {path} was still busy after {GIVE_UP_S} s")


def test_peak_memory_stays_under_the_caps_bound(capped_server):
    url, pid = capped_server.url, capped_server.process.pid
    with httpx.Client(base_url=url, timeout=60) as client:
        client.put("/api/v1/runs/r1", json={"name": "r1", "layers": make_layers(N_LAYERS)}
                   ).raise_for_status()
        client.post("/api/v1/runs/r1/batches",  # warm: first ingest, first analysis
                    json={"rank": 0, "seq": 0, "steps": make_steps(0, 5, N_LAYERS)}
                    ).raise_for_status()
    batches = {seq: near_cap_batch(seq) for seq in range(1, CLIENTS + 1)}
    huge_config = json.dumps({"config": {"blob": "z" * int(BODY_CAP * 0.9)}}).encode()
    over_cap = b"[" + b"0," * (BODY_CAP // 2) + b"0]"
    bomb = gzip.compress(b" " * (4 * BODY_CAP))  # 32 MiB of spaces in 32 KiB
    start = rss(pid)

    with ThreadPoolExecutor(CLIENTS + 8) as pool:
        stored = [pool.submit(send, url, "POST", "/api/v1/runs/r1/batches", body)
                  for body in batches.values()]
        refused = [pool.submit(send, url, "PUT", "/api/v1/runs/r1", huge_config)
                   for _ in range(4)]
        refused += [pool.submit(send, url, "POST", "/api/v1/runs/r1/batches", over_cap)
                    for _ in range(2)]
        refused += [pool.submit(send, url, "POST", "/api/v1/runs/r1/batches", bomb,
                                {"content-encoding": "gzip"}) for _ in range(2)]
        assert [f.result() for f in stored] == [200] * CLIENTS
        assert [f.result() for f in refused] == [422] * 4 + [413] * 4

    bound = start + PARSE_FACTOR * INFLIGHT_CAP
    peak = peak_rss(pid)
    assert peak < bound, (f"peak RSS {peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB"
                          f" (start {start / MiB:.0f} MiB + {PARSE_FACTOR} x the "
                          f"{INFLIGHT_CAP / MiB:.0f} MiB of bodies in flight)")
    print(f"near-cap batches: peak {(peak - start) / MiB:.0f} MiB above the start "
          f"(bound {PARSE_FACTOR * INFLIGHT_CAP / MiB:.0f} MiB)")
    run = httpx.get(f"{url}/api/v1/runs/r1", timeout=30).json()
    assert run["ranks"][0]["batches"] == CLIENTS + 1  # every batch stored once it got in


def invalid_bodies() -> dict[str, bytes]:
    """Bodies just under BODY_CAP that fail validation, each in its own costly way."""
    strings = {"rank": 0, "seq": 99, "steps": [
        {"step": i, "layer_grad_norm": ["x"] * 100_000} for i in range(15)]}
    late_error = {"rank": 0, "seq": 99, "steps": make_steps(0, 900, N_LAYERS)}
    late_error["steps"][-1]["layer_grad_norm"][-1] = "x"  # a valid body but its last value
    many_steps = {"rank": 0, "seq": 99, "steps": [
        {"step": i, "loss": "x", "grad_norm": "y", "lr": "z"} for i in range(100_000)]}
    events = {"rank": 0, "seq": 99, "steps": [], "events": [
        {"kind": "k", "detail": {f"\x00{j}": 1 for j in range(50)}} for _ in range(10_000)]}
    bodies = {name: json.dumps(body).encode() for name, body in (
        ("strings", strings), ("late_error", late_error), ("many_steps", many_steps),
        ("events", events))}
    for name, body in bodies.items():
        assert len(body) < BODY_CAP, name
    return bodies


def test_invalid_bodies_cost_no_more_than_valid_ones(capped_server):
    """Validation stops at the first error: a body of 100,000 strings per vector once
    cost about 800 times its size (1.5 MB -> +1 GB)."""
    url, pid = capped_server.url, capped_server.process.pid
    with httpx.Client(base_url=url, timeout=60) as client:
        client.put("/api/v1/runs/r1", json={"name": "r1", "layers": make_layers(N_LAYERS)}
                   ).raise_for_status()
    bodies = invalid_bodies()
    start = rss(pid)
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [pool.submit(send, url, "POST", "/api/v1/runs/r1/batches", body)
                   for body in bodies.values() for _ in range(CLIENTS // len(bodies))]
        assert [f.result() for f in answers] == [422] * len(answers)
    bound = start + PARSE_FACTOR * INFLIGHT_CAP
    peak = peak_rss(pid)
    assert peak < bound, (f"peak RSS {peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB"
                          f" (start {start / MiB:.0f} MiB)")
    print(f"invalid bodies: peak {(peak - start) / MiB:.0f} MiB above the start "
          f"(bound {PARSE_FACTOR * INFLIGHT_CAP / MiB:.0f} MiB)")


WIDE_LAYERS = 20_000
READ_BUDGET = 2 * layers_estimate(WIDE_LAYERS, 100)  # two whole-run matrices at once


@pytest.fixture
def read_capped_server(tmp_path):
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the server's peak memory from /proc (Linux)")
    server = LiveServer(f"sqlite:///{tmp_path / 'reads.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_INFLIGHT_READ_BYTES": str(READ_BUDGET)})
    server.start()
    yield server
    server.stop()


def test_reads_in_flight_stay_under_the_read_budget(read_capped_server):
    """16 concurrent whole-run heatmap matrices of a 20,000-layer run: the answers being
    built at once are capped by their estimated cost (the rest wait out 503s), so the
    peak stays near the budget. Without it, 16 such reads of a 100,000-layer run once
    took the server to +6 GB."""
    url, pid = read_capped_server.url, read_capped_server.process.pid
    with httpx.Client(base_url=url, timeout=300) as client:
        client.put("/api/v1/runs/wide", json={"name": "wide",
                                              "layers": make_layers(WIDE_LAYERS)}
                   ).raise_for_status()
        client.post("/api/v1/runs/wide/batches", json={
            "rank": 0, "seq": 0, "steps": make_steps(0, 3, WIDE_LAYERS)}).raise_for_status()
        path = "/api/v1/runs/wide/layers/matrix?buckets=100"
        assert client.get(path).status_code == 200  # warm: the first read
    start = rss(pid)
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [pool.submit(send, url, "GET", path, b"") for _ in range(CLIENTS)]
        assert [f.result() for f in answers] == [200] * CLIENTS
    peak = peak_rss(pid)
    bound = start + 2 * READ_BUDGET
    print(f"wide reads: peak {(peak - start) / MiB:.0f} MiB above the start (bound "
          f"{(bound - start) / MiB:.0f} MiB; budget {READ_BUDGET / MiB:.0f} MiB)")
    assert peak < bound, (f"peak RSS {peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} "
                          f"MiB (start {start / MiB:.0f} MiB + twice the read budget)")
