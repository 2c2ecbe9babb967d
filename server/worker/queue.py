"""The analysis queue: the durable hand-off from ingest to the detectors.

Ingest adds one `AnalysisTask` in the batch's own transaction (a batch rolled back leaves
no task); a worker (server/worker/analysis_worker.py) claims the oldest tasks of one
run, judges them in order and deletes them in the transaction that writes their
findings, so a worker killed at any point leaves each task either undone (and claimable
again) or done, never half.

Partitioned by run: on Postgres a claim holds the run's transaction-scoped advisory lock
(`pg_try_advisory_xact_lock`), and the rows `FOR UPDATE SKIP LOCKED`, so workers and
servers sharing one database never judge one run's batches at once nor out of order; on
SQLite one process writes at a time anyway.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, ScalarSelect, bindparam, delete, func, select
from sqlalchemy.orm import Session

from ampwatch.server.models import AnalysisTask, as_utc, utcnow

# session.info key: this session enqueued, so its commit wakes the embedded worker
ENQUEUED = "analysis_enqueued"
# Mixed into the run's advisory-lock key, so other users of advisory locks on the same
# database do not collide with ours
LOCK_SEED = 0x616D7077  # "ampw"
# runs held by other workers tried before a claim gives up (it retries when woken)
MAX_RUNS_TRIED = 32


def enqueue(session: Session, task: AnalysisTask) -> None:
    """Add `task` to the session's transaction; its commit hands it to a worker."""
    session.add(task)
    session.info[ENQUEUED] = True


def pending_batches(session: Session, run_id: str | None = None) -> int:
    """Stored batches not yet analysed, of one run or of all. One count over the queue's
    (run_id, id) index; the queue holds only unanalysed batches, so it stays small."""
    query = select(func.count()).select_from(AnalysisTask)
    if run_id is not None:
        query = query.where(AnalysisTask.run_id == run_id)
    return session.scalar(query) or 0


def pending_count(run_id: ColumnElement[str]) -> ScalarSelect[int]:
    """The run's batches still waiting, as a scalar subquery to select beside the run's
    row: read in the same statement, so in the same snapshot (a count of 0 then means
    the row already holds what the worker wrote). One probe of the (run_id, id) index."""
    return (select(func.count()).select_from(AnalysisTask)
            .where(AnalysisTask.run_id == run_id).scalar_subquery())


def oldest_enqueued(session: Session) -> datetime | None:
    """When the oldest batch still waiting was stored (None: the queue is empty)."""
    return as_utc(session.scalar(select(func.min(AnalysisTask.enqueued_at))))


def lag_seconds(session: Session) -> float:
    """Seconds the oldest waiting batch has waited: how far analysis is behind (0 when
    the queue is empty)."""
    oldest = oldest_enqueued(session)
    return 0.0 if oldest is None else max((utcnow() - oldest).total_seconds(), 0.0)


# built once: a worker runs them for every claim
_OLDEST_RUN = select(AnalysisTask.run_id).order_by(AnalysisTask.id).limit(1)
_RUN_LOCK = select(func.pg_try_advisory_xact_lock(
    func.hashtextextended(bindparam("run_id"), LOCK_SEED)))
_TASKS_OF_RUN = (select(AnalysisTask).where(AnalysisTask.run_id == bindparam("run_id"))
                 .order_by(AnalysisTask.id).limit(bindparam("limit"))
                 .with_for_update(skip_locked=True))
_DONE = delete(AnalysisTask).where(AnalysisTask.id.in_(bindparam("ids", expanding=True)))


def claim(session: Session, limit: int) -> list[AnalysisTask]:
    """The oldest tasks, up to `limit`, of the run with the oldest task that no other
    worker holds, in the order they were stored; empty when there is none. The run is
    this session's until its transaction ends (commit after judging and `done`)."""
    postgres = session.get_bind().dialect.name == "postgresql"
    passed: list[str] = []
    for _ in range(MAX_RUNS_TRIED):
        oldest = _OLDEST_RUN
        if passed:
            oldest = oldest.where(AnalysisTask.run_id.not_in(passed))
        run_id = session.scalar(oldest)
        if run_id is None:
            return []
        if postgres and not session.scalar(_RUN_LOCK, {"run_id": run_id}):
            passed.append(run_id)  # another worker judges this run now
            continue
        tasks = list(session.scalars(_TASKS_OF_RUN, {"run_id": run_id, "limit": limit}))
        if tasks:
            return tasks
        passed.append(run_id)  # its holder finished it since we looked
    return []


def done(session: Session, tasks: list[AnalysisTask]) -> None:
    """Delete `tasks` in the session's transaction (the one that wrote their findings)."""
    session.execute(_DONE, {"ids": [t.id for t in tasks]})
