"""Back-pressure that fits a real run: ordinary load waits its turn and is never refused;
503 + Retry-After only when the server is truly behind (no request slot frees within
AMPWATCH_SLOT_WAIT_S, or more batches await analysis than AMPWATCH_MAX_PENDING_BATCHES)."""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from ampwatch.server.app import close_app, create_app
from ampwatch.server.http.backpressure import BacklogMiddleware
from ampwatch.server.models import AnalysisTask
from ampwatch.server.settings import Settings
from ampwatch.server.worker.analysis_worker import AnalysisWorker
from ampwatch.server.worker.queue import pending_batches
from tests.conftest import LiveServer
from tests.utils import make_layers, make_steps, post_batch, register_run

THREADS = 16
REQUESTS = 64


def test_sixteen_threads_registering_one_run_are_never_refused(live_server):
    """A 64-rank run's start from a 16-thread client, on the default settings (16
    slots): with a cap that refused the excess at once, 4 to 24 of the 64 got 503
    (measured before issue 31), since a slot is held until the answer has left."""
    body = {"name": "wide", "project": "p", "layers": make_layers(64),
            "environment": {"world_size": REQUESTS}}

    with (httpx.Client(base_url=live_server.url, timeout=60,
                       limits=httpx.Limits(max_connections=THREADS)) as http,
          ThreadPoolExecutor(THREADS) as pool):  # one keep-alive client, as a user writes it
        statuses = list(pool.map(
            lambda _: http.put("/api/v1/runs/wide", json=body).status_code, range(REQUESTS)))
    assert statuses.count(503) == 0
    assert statuses == [200] * REQUESTS


@pytest.fixture
def one_slot(tmp_path: Path):
    server = LiveServer(f"sqlite:///{tmp_path / 'slot.db'}", tmp_path / "server.log", env={
        "AMPWATCH_MAX_CONCURRENT_REQUESTS": "1", "AMPWATCH_SLOT_WAIT_S": "0.3"})
    server.start()
    yield server
    server.stop()


def held_database(url: str) -> sqlite3.Connection:
    """A connection holding the SQLite file's write lock (BEGIN IMMEDIATE) until it is
    rolled back: the server's writes wait on it, holding their request slots."""
    connection = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    connection.execute("BEGIN IMMEDIATE")
    return connection


def test_only_a_request_that_waited_out_its_slot_gets_503(one_slot):
    server = one_slot
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.put("/api/v1/runs/r1", json={"name": "r1"}).raise_for_status()
        # a request that waits its turn briefly is served, not refused
        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(lambda _: http.get("/api/v1/runs").status_code,
                                range(8))) == {200}
        lock = held_database(server.database_url)
        try:
            with ThreadPoolExecutor(1) as pool:
                # takes the one slot and waits in the database
                writer = pool.submit(http.put, "/api/v1/runs/r2", json={"name": "r2"})
                time.sleep(0.5)
                started = time.monotonic()
                refused = http.get("/api/v1/runs")
                waited = time.monotonic() - started
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert "behind" in refused.json()["detail"]
                assert waited >= 0.3
                assert http.get("/api/v1/health").status_code == 200  # never takes a slot
                lock.rollback()
                assert writer.result(timeout=30).status_code == 200
        finally:
            lock.close()
        assert http.get("/api/v1/runs").json()["total"] == 2


def test_batches_wait_while_analysis_is_behind(tmp_path):
    """No worker drains (the embedded one is off): each stored batch waits in the queue,
    and past the limit new batches are refused until a worker catches up."""
    # reads answer at once: nothing drains the queue they would wait for
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'q.db'}",
                              max_pending_batches=2, embedded_worker=False,
                              analysis_wait_s=0))
    maker = app.state.sessionmaker
    try:
        with TestClient(app) as api:
            register_run(api, "r1")
            for seq in range(3):
                assert post_batch(api, "r1", seq, make_steps(5 * seq, 5, 4)).status_code == 200
            with maker() as session:
                assert pending_batches(session) == 3
            time.sleep(BacklogMiddleware.REFRESH_S)  # the depth is read once a REFRESH_S
            refused = post_batch(api, "r1", 3, make_steps(15, 5, 4))
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == str(BacklogMiddleware.RETRY_AFTER_S)
            assert "3 batches await analysis" in refused.json()["detail"]
            # reads and registration go on; only new batches wait
            assert api.get("/api/v1/runs/r1").json()["steps"] == 15
            register_run(api, "r2")
            assert AnalysisWorker(maker, app.state.settings).drain() == 3
            time.sleep(BacklogMiddleware.REFRESH_S)
            assert post_batch(api, "r1", 3, make_steps(15, 5, 4)).status_code == 200
            assert api.get("/api/v1/runs/r1").json()["steps"] == 20
    finally:
        close_app(app)


def test_the_queue_depth_is_read_at_most_once_a_refresh(tmp_path):
    """Whatever the batch rate, a server counts the queue once every REFRESH_S (the
    worker is off: its claims read the queue too)."""
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'q.db'}",
                              embedded_worker=False))
    looks: list[str] = []

    def statement(_conn, _cursor, sql: str, *_args) -> None:
        # the whole queue's depth (a run's own count, its `analysis_pending`, is not it)
        if "count(*)" in sql and AnalysisTask.__tablename__ in sql and "WHERE" not in sql:
            looks.append(sql)

    event.listen(app.state.engine, "before_cursor_execute", statement)
    try:
        with TestClient(app) as api:
            register_run(api, "r1")
            started = time.monotonic()
            for seq in range(20):
                assert post_batch(api, "r1", seq, make_steps(seq, 1, 4)).status_code == 200
            elapsed = time.monotonic() - started
        assert 1 <= len(looks) <= elapsed / BacklogMiddleware.REFRESH_S + 1
    finally:
        close_app(app)
