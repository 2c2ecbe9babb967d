"""A worker killed mid-drain loses nothing and duplicates nothing: the ground-truth fault
suite (tests/diagnosis/scenarios.py) trains into a server on Postgres whose detectors run
only in `ampwatch worker` processes; one is killed with SIGKILL while it drains, another
finishes, and every scenario's findings are exactly what the truth calls for and row for
row what one uninterrupted drain of the same stored batches writes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import sessionmaker

from ampwatch.server.settings import Settings
from ampwatch.server.worker.analysis_worker import AnalysisWorker
from ampwatch.server.worker.queue import LOCK_SEED, pending_batches
from tests.conftest import LiveServer, agent_errors_fail, empty_postgres, postgres_copy
from tests.server.test_worker import finding_rows

pytestmark = pytest.mark.postgres


def _pending(url: str, run_id: str | None = None) -> int:
    engine = create_engine(url)
    try:
        with sessionmaker(engine)() as session:
            return pending_batches(session, run_id)
    finally:
        engine.dispose()


def _worker(url: str, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ampwatch.client.cli", "worker", "--database-url", url,
             "--poll", "0.05", "--claim", "2"], stdout=out, stderr=subprocess.STDOUT)


def test_a_killed_worker_loses_and_duplicates_nothing(postgres_database: str,
                                                      tmp_path: Path) -> None:
    import torch

    from tests.diagnosis.scenarios import (
        SCENARIOS,
        expected,
        observed,
        train,
        weight_jump_holds,
    )

    torch.set_num_threads(1)
    url = postgres_database
    empty_postgres(url)
    server = LiveServer(url, tmp_path / "server.log", env={"AMPWATCH_EMBEDDED_WORKER": "0"})
    server.start(timeout=120)
    try:
        with agent_errors_fail():
            trained = [(scenario, *train(scenario, server.url)) for scenario in SCENARIOS]
    finally:
        server.stop()
    total = _pending(url)
    assert total >= len(SCENARIOS)  # nothing judged them yet
    with postgres_copy(url) as reference:
        # the same stored batches, drained once without interruption
        engine = create_engine(reference)
        try:
            settings = Settings(database_url=reference, embedded_worker=False)
            maker = sessionmaker(engine, expire_on_commit=False)
            assert AnalysisWorker(maker, settings).drain() == total
            want_rows = finding_rows(maker)
        finally:
            engine.dispose()

    log = tmp_path / "worker.log"
    # One open connection watches the queue; it also holds the last run's lock, as a
    # second worker judging that run would, so the first cannot drain everything before
    # the kill lands (it did once, between two polls of the watch).
    held = trained[-1][1]
    held_tasks = _pending(url, held)
    assert held_tasks > 0
    watch = sessionmaker(create_engine(url))
    first = None
    try:
        # one connection and one transaction: read committed, each count sees new commits
        with watch() as session:
            session.execute(select(func.pg_advisory_lock(
                func.hashtextextended(held, LOCK_SEED))))
            first = _worker(url, log)
            deadline = time.monotonic() + 120
            while pending_batches(session) >= total and time.monotonic() < deadline:
                time.sleep(0.002)
            first.send_signal(signal.SIGKILL)  # while it drains: its claim in hand rolls back
            first.wait(30)
            session.execute(select(func.pg_advisory_unlock_all()))
    finally:
        if first is not None and first.poll() is None:
            first.kill()
        watch.kw["bind"].dispose()
    left = _pending(url)
    assert _pending(url, held) == held_tasks  # the lock kept the first worker off it
    assert held_tasks <= left < total, log.read_text()[-2000:]

    second = _worker(url, log)
    deadline = time.monotonic() + 180
    while _pending(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0, log.read_text()[-2000:]
    assert _pending(url) == 0
    stopped = log.read_text().strip().splitlines()[-1]
    assert stopped == f"ampwatch: analysis worker stopped after {left} batches", stopped

    engine = create_engine(url)
    try:
        got_rows = finding_rows(sessionmaker(engine))
    finally:
        engine.dispose()
    assert got_rows == want_rows  # the run ids are the same: one database, copied
    server.start(timeout=120)
    try:
        for scenario, run_id, truth in trained:
            got, items = observed(server.url, run_id)
            # a weight jump is checked against the test's own norms, as the fault suite does
            jumps = [f for f in items if f["kind"] == "weight_jump" and f["code"] == "weight_jump"]
            assert all(weight_jump_holds(truth, f) for f in jumps), jumps
            got = {f for f in got if f[0] != "weight_jump"}
            assert got == expected(scenario, truth), (scenario.name, items)
            infos = {(f["kind"] if f["kind"] != "pitfall" else f"pitfall:{f['code']}",
                      f["layer"]) for f in items if f["severity"] == "info"}
            assert set(scenario.infos) <= infos, scenario.name
    finally:
        server.stop()
