"""An app made for one test does not outlive it: the test process used to end at about
2 GB resident because every test's app (about 4 MB) stayed reachable from FastAPI's
module-level caches of endpoint callables (tests/conftest.py releases them after each
test). The first two tests run in file order: the first keeps a weak reference to its app,
the second checks that nothing else does. Closing an app stops the threads it started
before it closes their connections."""

from __future__ import annotations

import gc
import threading
import weakref

from ampwatch.server.app import close_app
from ampwatch.server.schemas.batches import BatchIn
from ampwatch.server.schemas.runs import RunUpsert
from ampwatch.server.services.ingest import ingest_batch
from ampwatch.server.services.runs import upsert_run
from tests.utils import make_layers, make_steps

_made: list[weakref.ref] = []


def test_a_test_makes_an_app_and_uses_it(api, app) -> None:
    assert api.get("/api/v1/health").status_code == 200
    assert api.get("/docs").status_code == 200  # the docs endpoints that closed over it
    _made.append(weakref.ref(app))


def test_the_app_is_gone_once_its_test_is_over() -> None:
    assert _made, "the test before this one did not run"
    gc.collect()
    assert [ref for ref in _made if ref() is not None] == []


def test_closing_an_app_whose_lifespan_never_ran_stops_its_worker(app, settings) -> None:
    """A commit that enqueued starts the analysis worker's thread, lifespan or not;
    `close_app` stops it before it closes the connections. Disposing the engine alone left
    the thread draining: it checked its Postgres connection into the replaced pool, where
    it stayed open until the collector warned of it in some later test (issue 31)."""
    before = set(threading.enumerate())
    with app.state.sessionmaker() as session:
        upsert_run(session, "r1", RunUpsert(name="r1", layers=make_layers(4)), settings)
        ingest_batch(session, "r1", BatchIn.model_validate(
            {"rank": 0, "seq": 0, "steps": make_steps(0, 5, 4)}), settings)
    started = [t for t in set(threading.enumerate()) - before if t.name == "ampwatch-analysis"]
    assert started, "the commit did not start the worker's thread"
    close_app(app)
    assert not [t for t in started if t.is_alive()]
    pool = app.state.engine.pool
    assert (pool.checkedout(), pool.checkedin()) == (0, 0)


def test_a_worker_woken_before_its_lifespan_keeps_running_once_started(app, settings) -> None:
    """A commit before the lifespan starts the worker's thread in its lingering mode (it
    ends when idle for poll_s); the lifespan's start() must keep that thread running, or
    the server stops polling for batches other processes store."""
    worker = app.state.analysis_worker
    worker.poll_s = 0.05
    worker.wake()  # as a commit that enqueued would
    thread = worker._thread
    assert thread is not None and thread.is_alive()
    worker.start()  # the lifespan's
    thread.join(timeout=10 * worker.poll_s)  # a lingering thread would have ended by now
    assert thread.is_alive() and worker._thread is thread
    close_app(app)
    assert not thread.is_alive()
