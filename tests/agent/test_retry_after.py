"""The agent honours Retry-After, against a real server that is truly behind: one request
slot, held by a write waiting on the database, so every other request waits out
AMPWATCH_SLOT_WAIT_S and is answered 503 + Retry-After. The agent sends nothing sooner
than it was asked to, keeps training meanwhile, and loses nothing."""

from __future__ import annotations

import gzip
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from ampwatch import agent
from ampwatch.agent.transport.sender import retry_after_s
from tests.agent.factories import batches, bf16_loop, mlp
from tests.conftest import LiveServer, agent_errors_fail

SLOT_WAIT_S = 0.2  # the server answers Retry-After: 1 (whole seconds, rounded up)


@pytest.fixture
def behind(tmp_path: Path):
    server = LiveServer(f"sqlite:///{tmp_path / 'behind.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_CONCURRENT_REQUESTS": "1", "AMPWATCH_SLOT_WAIT_S": str(SLOT_WAIT_S)})
    server.start()
    yield server
    server.stop()


class Exchanges:
    """What the agent's own HTTP client sent and was answered, in order (seen through
    httpx's event hooks on it: the real requests, nothing replaced)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[int, float] = {}
        self.log: list[dict] = []

    def request(self, request: httpx.Request) -> None:
        with self.lock:
            self.sent[id(request)] = time.monotonic()

    def response(self, response: httpx.Response) -> None:
        request = response.request
        seq = None  # a batch's; the heartbeat (POST .../reached, not gzipped) has none
        if request.method == "POST" and request.url.path.endswith("/batches"):
            request.read()
            seq = json.loads(gzip.decompress(request.content))["seq"]
        with self.lock:
            self.log.append({"method": request.method, "seq": seq,
                             "sent": self.sent.pop(id(request)), "answered": time.monotonic(),
                             "status": response.status_code,
                             "retry_after": retry_after_s(response.headers.get("retry-after"))})


def watch(attachment, exchanges: Exchanges) -> None:
    """Hook `exchanges` into the attachment's sender once its delivery thread exists."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        delivery = attachment._worker.delivery
        if delivery is not None:
            hooks = delivery.sender._client.event_hooks
            hooks["request"].append(exchanges.request)
            hooks["response"].append(exchanges.response)
            return
        time.sleep(0.001)
    raise AssertionError("the agent's delivery never started")


def test_the_agent_waits_as_long_as_retry_after_asks_and_loses_nothing(behind):
    server = behind
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.put("/api/v1/runs/other", json={"name": "other"}).raise_for_status()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    exchanges = Exchanges()
    lock = sqlite3.connect(server.database_url.removeprefix("sqlite:///"), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the server's writes wait: it is behind
    with (agent_errors_fail(), ThreadPoolExecutor(1) as pool,
          httpx.Client(base_url=server.url, timeout=60) as http):
        # a write that takes the one slot and waits in the database
        holder = pool.submit(http.put, "/api/v1/runs/other", json={"tags": ["held"]})
        time.sleep(0.3)
        attachment = agent.attach(model, server=server.url, flush_interval=0.05,
                                  max_batch_steps=4)
        try:
            watch(attachment, exchanges)
            for x_y in batches(20):  # training goes on while the server is behind
                bf16_loop(model, optimizer, [x_y])
                time.sleep(0.1)
            time.sleep(1.0)
            lock.rollback()
            assert holder.result(timeout=30).status_code == 200
            bf16_loop(model, optimizer, batches(20, seed=2))
            assert attachment.flush(30)
        finally:
            lock.close()
            attachment.detach()
        run = http.get(f"/api/v1/runs/{attachment.run_id}").json()
    assert run["steps"] == 40 and run["lost_batches"] == 0 and run["missing_steps"] == 0
    log = exchanges.log
    refused = [e for e in log if e["status"] == 503]
    assert refused, "the server was never behind: the test proved nothing"
    assert all(e["retry_after"] == 1.0 for e in refused)
    for answer, following in zip(log, log[1:], strict=False):
        if answer["status"] == 503:  # the next send waited at least as long as asked
            assert following["sent"] - answer["answered"] >= answer["retry_after"], (
                answer, following)
    stored = [e["seq"] for e in log if e["seq"] is not None and e["status"] == 200]
    assert sorted(stored) == sorted(set(stored))  # each batch committed once


@pytest.mark.parametrize(("header", "seconds"), [
    (None, None), ("", None), ("soon", None), ("3", 3.0), ("100000", 300.0),
    ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0)])
def test_retry_after_values(header, seconds):
    assert retry_after_s(header) == seconds
