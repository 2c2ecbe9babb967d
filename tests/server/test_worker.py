"""The analysis queue and its worker (server/worker/analysis_worker.py): ingest answers before the
detectors run and hands them a durable task; a worker judges it exactly as the request
once did, one run at a time, from rank windows it keeps in memory."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from ampwatch.server.analysis.window_cache import RankWindows
from ampwatch.server.app import close_app, create_app
from ampwatch.server.models import Finding
from ampwatch.server.settings import Settings
from ampwatch.server.store.storage import load_batches
from ampwatch.server.worker.analysis_worker import AnalysisWorker
from ampwatch.server.worker.queue import claim, pending_batches
from ampwatch.wire import FINISHED_EVENT, encode_tree
from tests.server.analysis.factories import scaler_steps
from tests.utils import post_batch, register_run

ENV = {"autocast_dtype": "float16", "scaler": {"growth_interval": 2000, "enabled": True}}
N_LAYERS = 4


def post(api, run_id: str, steps: list[dict], *, rank: int = 0, first_seq: int = 0,
         per_batch: int = 25, **fields) -> None:
    for i in range(0, len(steps), per_batch):
        body = {"rank": rank, "seq": first_seq + i // per_batch,
                "steps": encode_tree(steps[i:i + per_batch]), **fields}
        response = api.post(f"/api/v1/runs/{run_id}/batches", json=body)
        assert response.status_code == 200, response.text


def finding_rows(maker) -> list[tuple]:
    """Every finding as the API would tell it, in a stable order."""
    with maker() as session:
        rows = session.execute(select(
            Finding.run_id, Finding.rank, Finding.kind, Finding.code, Finding.key,
            Finding.severity, Finding.status, Finding.step, Finding.last_step,
            Finding.layer, Finding.count, Finding.message)).all()
    return sorted(tuple(r) for r in rows)


@pytest.fixture
def idle_app(database_url: str):
    """An app whose worker never runs by itself: tests drain it."""
    app = create_app(Settings(database_url=database_url, embedded_worker=False,
                              analysis_wait_s=0))
    yield app
    close_app(app)


def diverging(first_skip: int = 100, total: int = 200) -> list[dict]:
    """Steps whose scaler skips every step from `first_skip` on (a critical streak)."""
    return scaler_steps(total, overflow=range(first_skip, total), init_scale=2.0**40)


def test_ingest_answers_first_and_the_worker_finds_what_inline_analysis_found(
        idle_app, database_url: str, tmp_path) -> None:
    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging())
        # registration judged the setup; nothing judged the steps yet
        assert {f["kind"] for f in api.get("/api/v1/runs/r1/findings").json()["items"]} \
            == {"pitfall"}
        with maker() as session:
            assert pending_batches(session) == 8
            assert pending_batches(session, "r1") == 8
            assert pending_batches(session, "nope") == 0
        text = api.get("/metrics").text
        assert "ampwatch_analysis_backlog_batches 8.0" in text
        assert _gauge(text, "ampwatch_analysis_lag_seconds") > 0
        worker = AnalysisWorker(maker, idle_app.state.settings)
        assert worker.drain() == 8
        with maker() as session:
            assert pending_batches(session) == 0
        streaks = [f for f in api.get("/api/v1/runs/r1/findings").json()["items"]
                   if f["kind"] == "scaler_divergence"
                   and f["evidence"]["check"] == "skip_streak"]
        assert [(f["step"], f["last_step"], f["severity"]) for f in streaks] == \
            [(100, 199, "critical")]
        assert api.get("/api/v1/runs/r1").json()["status"] == "critical"
        text = api.get("/metrics").text
        assert "ampwatch_analysis_backlog_batches 0.0" in text
        assert _gauge(text, "ampwatch_analysis_lag_seconds") == 0
    # the same batches on a server whose own worker thread judges them as they arrive
    embedded = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'e.db'}",
                                   analysis_wait_s=0))
    with TestClient(embedded) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging())
        assert embedded.state.analysis_worker.wait_idle(30)
        with embedded.state.sessionmaker() as session:
            assert pending_batches(session) == 0
    assert _without_times(finding_rows(embedded.state.sessionmaker)) == \
        _without_times(finding_rows(maker))
    close_app(embedded)


def test_the_embedded_worker_gathers_back_to_back_batches_into_one_claim(tmp_path) -> None:
    """A commit's wake waits `settle_s` for the next commits, so batches posted back to
    back share one claim (the claim's own reads and commit are paid once); a reader
    waiting for the findings does not wait out the settling."""
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 's.db'}",
                              analysis_wait_s=0))
    worker = app.state.analysis_worker
    assert worker.settle_s > 0 and worker.claim_size == 4
    worker.settle_s = 30.0  # longer than posting three batches takes, however loaded
    with TestClient(app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging(first_skip=10, total=75))  # three batches
        start = time.monotonic()
        assert worker.wait_idle(60)
        assert time.monotonic() - start < 20  # hurried, not settled for 30 s
        assert (worker.analysed, worker.claims) == (3, 1)
        streaks = [f for f in api.get("/api/v1/runs/r1/findings").json()["items"]
                   if f["kind"] == "scaler_divergence"
                   and f["evidence"]["check"] == "skip_streak"]
        assert [(f["step"], f["last_step"], f["severity"]) for f in streaks] == \
            [(10, 74, "critical")]
    close_app(app)


def test_the_embedded_worker_takes_its_batches_from_ingest_not_storage(tmp_path) -> None:
    """Ingest hands each committed batch, unpacked, to its own worker's windows: the
    worker reads no batch back, and what it judged is what storage holds."""
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'h.db'}",
                              analysis_wait_s=0))
    worker = app.state.analysis_worker
    worker.settle_s = 30.0  # judged after every hand-over, however loaded the machine
    with TestClient(app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging(first_skip=60, total=100), per_batch=20)
        post(api, "r1", diverging(first_skip=60, total=100)[90:], first_seq=5)  # a resend
        assert worker.wait_idle(60)
        assert worker.analysed == 6 and worker.windows.reads == 0
        with app.state.sessionmaker() as session:
            held = worker.windows.batches(session, "r1", 0, 0, 99, n_layers=N_LAYERS)
        assert worker.windows.reads == 0
    with app.state.sessionmaker() as session:
        stored = load_batches(session, "r1", 0, 0, 99, n_layers=N_LAYERS)
    assert [_content(p) for p in held] == [_content(p) for p in stored]
    close_app(app)


def test_offered_batches_stay_within_their_window(idle_app) -> None:
    """What ingest hands over is bounded by the window its judgement reads, whether or
    not this worker judges it (on Postgres another server's worker may)."""
    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging(total=300), per_batch=20)
    with maker() as session:
        parts = load_batches(session, "r1", 0, 0, 299, n_layers=N_LAYERS)
    windows = RankWindows()
    for seq, part in enumerate(parts):
        first, last = int(part.steps[0]), int(part.steps[-1])
        windows.offer("r1", 0, (seq, first, last, None), part, keep_from=first - 100)
    with maker() as session:  # held: the last batch and the 100 steps before it
        got = windows.batches(session, "r1", 0, 180, 299, n_layers=N_LAYERS)
    assert windows.reads == 0 and len(got) == 6
    with maker() as session:
        windows.batches(session, "r1", 0, 160, 299, n_layers=N_LAYERS)
    assert windows.reads == 1  # steps 160..179 had gone


def _gauge(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def _without_times(rows: list[tuple]) -> list[tuple]:
    return [r[1:] for r in rows]  # run ids are the same; no row holds a time


def test_windows_read_each_batch_once_and_equal_storage(idle_app) -> None:
    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging(total=300), per_batch=20)
        # a resend of steps 290..299 under a new seq (a resumed agent)
        post(api, "r1", diverging(total=300)[290:], first_seq=15)
    windows = RankWindows()
    with maker() as session:
        for end in range(19, 300, 20):
            start = max(end - 120, 0)
            got = windows.batches(session, "r1", 0, start, end, n_layers=N_LAYERS,
                                  keep_from=end + 20 - 120)  # the next window's start
            want = load_batches(session, "r1", 0, start, end, n_layers=N_LAYERS)
            assert [_content(p) for p in got] == [_content(p) for p in want]
        assert windows.reads == 16  # each stored batch read once
        got = windows.batches(session, "r1", 0, 250, 299, n_layers=N_LAYERS,
                              with_layers=False)
        want = load_batches(session, "r1", 0, 250, 299, n_layers=N_LAYERS,
                            with_layers=False)
        assert [_content(p) for p in got] == [_content(p) for p in want]
        assert windows.reads == 16  # all of them held already
        small = RankWindows(max_bytes=1)  # holds one rank's batches at most
        small.batches(session, "r1", 0, 0, 299, n_layers=N_LAYERS)
        assert small.nbytes > 0


def _content(series) -> tuple:
    arrays = (series.scalars, series.present, series.layer_grad, series.act_step,
              series.act_absmax, series.act_dtype, series.act_time, series.act_grad_zero)
    return (tuple(None if a is None else a.tobytes() for a in arrays), series.n_layers,
            repr(series.events))


@pytest.mark.postgres
def test_a_run_held_by_one_worker_is_skipped_by_the_others(postgres_database: str) -> None:
    from tests.conftest import empty_postgres

    empty_postgres(postgres_database)
    app = create_app(Settings(database_url=postgres_database, embedded_worker=False,
                              analysis_wait_s=0))
    maker = app.state.sessionmaker
    with TestClient(app) as api:
        for run_id in ("a", "b"):
            register_run(api, run_id, N_LAYERS, environment=ENV)
            post(api, run_id, diverging(total=100))
    with maker() as first, maker() as second:
        held = claim(first, 2)
        assert [t.run_id for t in held] == ["a", "a"]
        assert [t.seq for t in held] == [0, 1]
        other = claim(second, 10)  # "a" is held: its later batches wait for its holder
        assert {t.run_id for t in other} == {"b"} and len(other) == 4
        second.rollback()
        first.rollback()
        assert [t.run_id for t in claim(second, 1)] == ["a"]  # released with the txn
        second.rollback()
    close_app(app)


@pytest.mark.postgres
def test_workers_in_parallel_judge_every_batch_once(postgres_database: str) -> None:
    from tests.conftest import empty_postgres

    empty_postgres(postgres_database)
    settings = Settings(database_url=postgres_database, embedded_worker=False,
                        analysis_wait_s=0)
    app = create_app(settings)
    maker = app.state.sessionmaker
    with TestClient(app) as api:
        for run_id in ("a", "b", "c"):
            register_run(api, run_id, N_LAYERS, environment=ENV)
            post(api, run_id, diverging(), per_batch=10)
    workers = [AnalysisWorker(maker, settings, claim_size=3) for _ in range(3)]
    threads = [threading.Thread(target=w.drain) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    workers[0].drain()  # a worker stops when every run left is held by another
    assert sum(w.analysed for w in workers) == 60
    assert all(w.analysed for w in workers)
    with maker() as session:
        assert pending_batches(session) == 0
    rows = finding_rows(maker)
    streaks = [r for r in rows if r[2] == "scaler_divergence" and "skip_streak" in r[4]]
    assert [(r[0], r[7], r[8], r[5]) for r in streaks] == \
        [(run, 100, 199, "critical") for run in ("a", "b", "c")]
    close_app(app)


def test_a_batch_that_cannot_be_judged_is_dropped_and_the_rest_judged(
        idle_app, caplog: pytest.LogCaptureFixture) -> None:
    from sqlalchemy import update

    from ampwatch.server.models import Batch

    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        for run_id in ("bad", "good"):
            register_run(api, run_id, N_LAYERS, environment=ENV)
            post(api, run_id, diverging())
    with maker() as session:  # the last stored batch of "bad" no longer unpacks
        session.execute(update(Batch).where(Batch.run_id == "bad", Batch.seq == 7)
                        .values(scalars=b"\x00" * 3, present=b"\x00" * 3, format=1))
        session.commit()
    worker = AnalysisWorker(maker, idle_app.state.settings, claim_size=5)
    assert worker.drain() == 16
    assert worker.analysed == 15  # the bad one is counted as taken, not as judged
    with maker() as session:
        assert pending_batches(session) == 0
    assert "run bad rank 0 seq 7 failed twice" in caplog.text
    streaks = [r for r in finding_rows(maker)
               if r[2] == "scaler_divergence" and r[0] == "good" and r[5] == "critical"]
    assert streaks


def test_ampwatch_worker_drains_and_stops_on_sigterm(idle_app, database_url: str,
                                                     tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        post(api, "r1", diverging())
    process = subprocess.Popen(
        [sys.executable, "-m", "ampwatch.client.cli", "worker", "--database-url",
         database_url, "--poll", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with maker() as session:
            if not pending_batches(session):
                break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    assert out.strip().splitlines()[-1] == "ampwatch: analysis worker stopped after 8 batches"
    assert any(r[2] == "scaler_divergence" and r[5] == "critical" for r in finding_rows(maker))


def test_a_run_tells_how_many_of_its_batches_wait_for_analysis(idle_app) -> None:
    maker = idle_app.state.sessionmaker
    with TestClient(idle_app) as api:
        register_run(api, "r1", N_LAYERS, environment=ENV)
        register_run(api, "r2", N_LAYERS, environment=ENV)
        assert api.get("/api/v1/runs/r1").json()["analysis_pending"] == 0
        post(api, "r1", diverging())  # 8 batches
        post(api, "r2", diverging(total=50))  # 2 batches
        # training ended: the page stops polling for steps, not yet for findings
        assert post_batch(api, "r1", 8, [], events=[{"kind": FINISHED_EVENT}]).status_code == 200
        run = api.get("/api/v1/runs/r1").json()
        assert run["analysis_pending"] == 8 and run["finished"] and not run["live"]
        assert run["status"] == "healthy"  # its steps are not judged yet
        listed = {r["id"]: r["analysis_pending"]
                  for r in api.get("/api/v1/runs").json()["items"]}
        assert listed == {"r1": 8, "r2": 2}
        twin = api.get("/runs/r1?format=json").json()
        assert twin["run"]["analysis_pending"] == 8
        assert "analysis of 8 batches pending" in api.get("/runs/r1").text
        update = api.get("/runs/r1?format=update").json()
        assert "analysis of 8 batches pending" in update["panels"]["run-status"]
        assert update["live"] is True  # the page polls until the findings are in

        assert AnalysisWorker(maker, idle_app.state.settings).drain() == 10
        run = api.get("/api/v1/runs/r1").json()
        assert run["analysis_pending"] == 0 and run["status"] == "critical"
        assert any(f["kind"] == "scaler_divergence"
                   for f in api.get("/api/v1/runs/r1/findings").json()["items"])
        assert {r["analysis_pending"] for r in api.get("/api/v1/runs").json()["items"]} == {0}
        assert "analysis-pending" not in api.get("/runs/r1").text
        update = api.get("/runs/r1?format=update").json()
        assert "pending" not in update["panels"]["run-status"]
        assert update["live"] is False
