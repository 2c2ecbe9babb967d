"""Eight processes register the same new run at once, as DDP ranks do at start: every PUT
succeeds (Postgres: one server; SQLite: two servers on one file)."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import pytest

from tests.conftest import LiveServer, empty_postgres
from tests.utils import make_layers

PROCESSES = 8
RUNS = 5


def register_all(base_url: str, rank: int, start_at: float) -> list[int]:
    """One rank: wait for the common start, then PUT each run id once, as fast as it can."""
    codes = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        http.get("/api/v1/health")  # connect before the start
        time.sleep(max(0.0, start_at - time.time()))
        for i in range(RUNS):
            body = {"name": f"race {i}", "tags": [f"rank{rank}"], "layers": make_layers(4),
                    "environment": {"world_size": PROCESSES}}
            codes.append(http.put(f"/api/v1/runs/race-{i}", json=body).status_code)
    return codes


def race(urls: list[str]) -> list[int]:
    start_at = time.time() + 3.0
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=context) as pool:
        futures = [pool.submit(register_all, urls[rank % len(urls)], rank, start_at)
                   for rank in range(PROCESSES)]
        return [code for f in futures for code in f.result()]


def check_runs(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        runs = http.get("/api/v1/runs", params={"name": "race"}).json()
        assert runs["total"] == RUNS
        for run in runs["items"]:
            assert run["n_layers"] == 4 and len(run["tags"]) == 1
            layers = http.get(f"/api/v1/runs/{run['id']}/layers").json()["items"]
            assert [layer["index"] for layer in layers] == [0, 1, 2, 3]


@pytest.mark.postgres
def test_eight_processes_register_one_run_on_postgres(postgres_database, tmp_path):
    empty_postgres(postgres_database)
    server = LiveServer(postgres_database, tmp_path / "server.log")
    server.start()
    try:
        codes = race([server.url])
        assert codes == [200] * (PROCESSES * RUNS), server.log_path.read_text()[-3000:]
        check_runs(server.url)
    finally:
        server.stop()


def test_two_servers_on_one_sqlite_file_register_one_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    servers = [LiveServer(url, tmp_path / f"server{i}.log") for i in range(2)]
    for server in servers:
        server.start()
    try:
        codes = race([s.url for s in servers])
        logs = "".join(s.log_path.read_text()[-2000:] for s in servers)
        assert codes == [200] * (PROCESSES * RUNS), logs
        check_runs(servers[0].url)
    finally:
        for server in servers:
            server.stop()
