"""The analysis worker: drains the analysis queue (server/worker/queue.py), judging each
stored batch with the detectors as the ingest request once did, off the request path.

It runs as `ampwatch worker` processes (server/cli.py) beside any number of servers, and
as a thread inside each server unless `embedded_worker` is off (the embedded SQLite
default keeps its two-command start). Each claim takes one run's oldest batches, judges
them in order, writes their findings and deletes them in one transaction. Recent rank
windows stay in memory (server/analysis/window_cache.py) and are rebuilt from storage by the
same path after a restart. `pending_batches` (re-exported here) is the queue depth that
back-pressure reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import event
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.analysis import service as analysis
from ampwatch.server.analysis.window_cache import RankWindows
from ampwatch.server.db import make_engine, session_info, writing
from ampwatch.server.faults import DatabaseHealth
from ampwatch.server.models import AnalysisTask, Run
from ampwatch.server.services.ranks import SHARDED, grad_layout
from ampwatch.server.settings import Settings
from ampwatch.server.store import combined
from ampwatch.server.worker.queue import (
    ENQUEUED,
    claim,
    done,
    pending_batches,
)

__all__ = ["AnalysisWorker", "pending_batches", "settle"]

log = logging.getLogger("ampwatch.worker")

# The embedded thread shares the request's core (and GIL): gathering a fifth of a second
# of commits into one claim cut its CPU a batch by about a third for a sender posting
# back to back (docs/benchmarks.md), for findings a fifth of a second later.
EMBEDDED_SETTLE_S = 0.2


class AnalysisWorker:
    """Drains the analysis queue of `maker`'s database.

    `drain()` judges queued batches until none is left that this worker may take (runs
    another worker holds are left to it). `start()` runs a daemon thread that drains
    whenever `wake()` is called (the app's commits call it) and every `poll_s` (batches
    that other processes stored); `stop()` ends it after the claim in progress.

    claim_size: batches of one run judged per transaction. On SQLite a claim holds the
    process's write lock, so ingest waits for at most one claim: keep it small there.
    on_analysed: called with each batch's seconds of analysis (a metrics histogram).
    settle_s: after a commit's wake, how long the thread waits for the next commits before
    it claims, so that one claim (its queue reads, its delete, its commit) serves several
    batches instead of one: a sender posting back to back otherwise pays that overhead on
    every batch, on the request's own core. A read that waits for analysis (`wake(now=
    True)`) does not wait for it.
    """

    def __init__(self, maker: sessionmaker, settings: Settings, *, claim_size: int | None = None,
                 poll_s: float = 1.0, settle_s: float = 0.0,
                 on_analysed: Callable[[float], None] | None = None) -> None:
        self.maker = maker
        self.settings = settings
        sqlite = maker.kw["bind"].dialect.name == "sqlite"
        self.claim_size = claim_size or (4 if sqlite else 64)
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.on_analysed = on_analysed
        self.windows = RankWindows(settings.worker_window_bytes)
        self.analysed = 0  # batches judged and committed by this worker
        self.claims = 0  # the claims that judged them
        self._wake = threading.Event()
        self._now = threading.Event()  # drain without settling (a read waits, or stop)
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._linger = False  # the thread ends when idle for poll_s (started by a wake)
        self._thread: threading.Thread | None = None

    def drain(self, stop: threading.Event | None = None) -> int:
        """Judge claims until the queue holds nothing this worker may take (or `stop` is
        set); returns the batches judged."""
        total = 0
        while stop is None or not stop.is_set():
            judged = self.drain_once()
            if not judged:
                return total
            total += judged
        return total

    def drain_once(self) -> int:
        """One claim: judge up to `claim_size` batches of one run and commit; 0 when there
        was nothing to take. A batch whose analysis fails is judged alone next, and
        dropped from the queue with a logged error if it fails alone (one bad batch must
        not hold its run's findings back for ever)."""
        try:
            return self._claim_and_judge(self.claim_size)
        except OperationalError:
            raise  # the database is away: the caller waits and tries again
        except Exception:
            log.exception("analysis of a claim failed; judging its batches one at a time")
        try:
            return self._claim_and_judge(1)
        except OperationalError:
            raise
        except Exception:
            self._drop_oldest()
            return 1

    def _claim_and_judge(self, limit: int) -> int:
        with self.maker() as session, writing(session):
            tasks = claim(session, limit)
            if not tasks:
                session.rollback()
                return 0
            folds = [self._judge(session, task) for task in tasks]
            run = session.get(Run, tasks[0].run_id)  # a claim is one run's
            if run is not None and grad_layout(run) == SHARDED:
                combined.fold(session, run.id, [f for f in folds if f is not None])
            done(session, tasks)
            session.commit()
        self.analysed += len(tasks)
        self.claims += 1
        return len(tasks)

    def _judge(self, session: Session, task: AnalysisTask) -> combined.Fold | None:
        """The detectors on one stored batch, as the request that stored it saw the rank;
        returns what the combined norms fold of it (None: the batch is gone)."""
        start = time.perf_counter()
        run = session.get(Run, task.run_id)
        batch = None if run is None else self.windows.stored(
            session, task.run_id, task.rank, task.seq, n_layers=run.n_layers)
        if batch is None:  # the run or batch was deleted meanwhile
            return None
        settings = self.settings.analysis
        analysis.on_ingest(session, run, task.rank, batch, settings,
                           rank_last_step=task.rank_last_step, current=task.current,
                           fp8=task.fp8, spikes=task.spikes, windows=self.windows)
        if task.ranks_through is not None:
            analysis.on_ranks_advanced(session, run, task.ranks_through, settings,
                                       windows=self.windows)
        if self.on_analysed is not None:
            self.on_analysed(time.perf_counter() - start)
        return combined.Fold(task.rank, batch, task.rank_last_step)

    def _drop_oldest(self) -> None:
        """Take the batch that failed alone off the queue, saying which."""
        with self.maker() as session, writing(session):
            tasks = claim(session, 1)
            if tasks:
                task = tasks[0]
                log.error("analysis of run %s rank %d seq %d failed twice; its batch stays "
                          "stored but is not judged", task.run_id, task.rank, task.seq)
                done(session, tasks)
            session.commit()

    # -- the thread --------------------------------------------------------------------

    def wake(self, now: bool = False) -> None:
        """Drain soon (a commit enqueued: after `settle_s`) or, with `now`, at once.
        Starts the thread if it is not running; started so, it ends after `poll_s`
        without work (an app whose lifespan never ran, as in a test's TestClient, has no
        lifespan to stop it: its owner calls `close_app`)."""
        if now:
            self._now.set()
        self._wake.set()
        with self._idle:
            if self._thread is None or not self._thread.is_alive():
                self.start(linger=True)

    def start(self, *, linger: bool = False) -> None:
        """Run the thread until `stop()` (with `linger`, until idle for `poll_s`). A
        lingering thread already running (a commit woke it before the lifespan started)
        is kept running until `stop()` instead."""
        with self._idle:
            if self._thread is not None and self._thread.is_alive():
                self._linger = self._linger and linger
                return
            self._linger = linger
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ampwatch-analysis",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after the claim in progress (waits up to `timeout`)."""
        self._stop.set()
        self._now.set()
        self._wake.set()
        thread = self._thread  # a lingering thread clears the attribute as it ends
        if thread is not None:
            thread.join(timeout)
            self._thread = None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until this worker found the queue empty after the last wake (or `timeout`
        passed); True when it did. Cheap when idle: no database read. Someone waits, so
        a wake still settling drains at once."""
        deadline = time.monotonic() + timeout
        if self._wake.is_set():
            self._now.set()
        with self._idle:
            while self._busy or self._wake.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._idle.wait(left)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self.poll_s)
            if not woken:
                with self._idle:  # a wake() from now on starts a new thread
                    if self._linger and not self._wake.is_set():
                        self._thread = None
                        return
            if woken and self.settle_s:
                self._now.wait(self.settle_s)
            with self._idle:
                self._wake.clear()
                self._now.clear()
                self._busy = True
            try:
                self.drain(self._stop)
            except Exception:  # the database is away or failing: try again after poll_s
                log.exception("analysis worker: draining the queue failed")
                self._stop.wait(self.poll_s)
            finally:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()


def embedded_worker(maker: sessionmaker, settings: Settings,
                    on_analysed: Callable[[float], None] | None = None) -> AnalysisWorker:
    """The worker thread of a server: woken by every commit of `maker`'s sessions that
    enqueued a batch, so its lag is the analysis time plus `EMBEDDED_SETTLE_S`, not a
    poll interval."""
    worker = AnalysisWorker(maker, settings, settle_s=EMBEDDED_SETTLE_S, on_analysed=on_analysed)

    def woken(session: Session) -> None:
        if session.info.pop(ENQUEUED, False):
            worker.wake()

    event.listen(maker, "after_commit", woken)
    return worker


def settle(maker: sessionmaker, worker: AnalysisWorker | None, wait_s: float,
           run_id: str | None = None) -> int:
    """Block up to `wait_s` until the queue holds no batch of `run_id` (of any run when
    None); returns the batches still pending then (0: the findings are all in). Wakes the
    embedded worker; polls for what another process's worker judges."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with maker() as session:
                pending = pending_batches(session, run_id)
        except SQLAlchemyError:  # the request itself meets the fault and answers it
            return 0
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            return pending
        if worker is not None:
            worker.wake()
            worker.wait_idle(min(left, 1.0))
        # what is left belongs to another process's worker, which polls the queue itself
        time.sleep(min(left, 0.01 if worker is not None else 0.1))


def run_worker(settings: Settings, stop: threading.Event, *, poll_s: float = 1.0,
               claim_size: int | None = None) -> int:
    """`ampwatch worker`: drain the queue of `settings.database_url` until `stop` is set,
    polling every `poll_s` when idle; returns the batches judged."""
    engine = make_engine(settings.database_url)
    maker = sessionmaker(engine, expire_on_commit=False,
                         info=session_info(engine, DatabaseHealth()))
    try:
        worker = AnalysisWorker(maker, settings, claim_size=claim_size, poll_s=poll_s)
        while not stop.is_set():
            try:
                if not worker.drain(stop):
                    stop.wait(poll_s)
            except OperationalError as exc:
                log.warning("analysis worker: database unavailable (%s); retrying",
                            str(exc).splitlines()[0])
                stop.wait(poll_s)
        return worker.analysed
    finally:
        engine.dispose()
