"""Eight senders at once against a real server process: nothing lost or duplicated."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import LiveServer
from tests.utils import make_layers, make_steps

SENDERS = 8
BATCHES = 12
STEPS = 25


@pytest.fixture
def server(database_url, tmp_path):
    live = LiveServer(database_url, tmp_path / "server.log")
    live.start()
    yield live
    live.stop()


def test_concurrent_ingest_from_eight_senders(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.put("/api/v1/runs/multi", json={"layers": make_layers(8)}).raise_for_status()

    def sender(rank: int) -> list[dict]:
        acks = []
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for seq in range(BATCHES):
                steps = make_steps(seq * STEPS, STEPS, 8, skipped={seq * STEPS})
                body = {"rank": rank, "seq": seq, "steps": steps}
                acks.append(http.post("/api/v1/runs/multi/batches", json=body).json())
                if seq % 4 == 0:  # a retry after a lost response must not duplicate
                    acks.append(http.post("/api/v1/runs/multi/batches", json=body).json())
        return acks

    with ThreadPoolExecutor(SENDERS) as pool:
        acks = [a for result in pool.map(sender, range(SENDERS)) for a in result]

    assert sum(a["stored_steps"] for a in acks) == SENDERS * BATCHES * STEPS
    assert sum(a["duplicate"] for a in acks) == SENDERS * (BATCHES // 4)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        run = http.get("/api/v1/runs/multi").json()
        assert run["steps"] == SENDERS * BATCHES * STEPS and run["lost_batches"] == 0
        assert run["skipped"] == SENDERS * BATCHES
        for rank in range(SENDERS):
            items = http.get(f"/api/v1/runs/multi/steps?rank={rank}").json()["items"]
            assert [s["step"] for s in items] == list(range(BATCHES * STEPS))


def test_registering_while_ingesting_never_fails(server):
    """An agent re-registers (PUT) while other ranks ingest: both always succeed."""
    layers = make_layers(8)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.put("/api/v1/runs/busy", json={"layers": layers}).raise_for_status()

    def ingest(rank: int) -> list[int]:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return [http.post("/api/v1/runs/busy/batches", json={
                "rank": rank, "seq": seq, "steps": make_steps(seq * 10, 10, 8)}).status_code
                for seq in range(15)]

    def register(_: int) -> list[int]:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return [http.put("/api/v1/runs/busy", json={"tags": [str(i)], "layers": layers})
                    .status_code for i in range(15)]

    with ThreadPoolExecutor(4) as pool:
        codes = [c for result in pool.map(lambda f: f[0](f[1]),
                                          [(ingest, 0), (ingest, 1), (register, 0),
                                           (register, 1)]) for c in result]
    assert set(codes) == {200}
