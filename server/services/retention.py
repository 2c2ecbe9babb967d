"""Retention: archiving a run (its full-resolution data dropped, its step summaries,
findings and totals kept) and handing freed space back to the file system."""

from __future__ import annotations

import os

from sqlalchemy import delete, insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ampwatch.server.db import writing
from ampwatch.server.errors import Conflict
from ampwatch.server.models import (
    Batch,
    CombinedNorms,
    CombinedRank,
    Fp8Sample,
    Run,
    RunRank,
    SpikeSample,
    utcnow,
)
from ampwatch.server.services.runs import get_run, run_ranks
from ampwatch.server.store.codec import encode_columns
from ampwatch.server.store.restarts import rebuild_summaries
from ampwatch.server.store.storage import new_batch_row
from ampwatch.server.store.summaries import summarised_steps


def archive_run(session: Session, run_id: str) -> Run:
    """Drop the run's stored steps and FP8 samples; keep the run, its layers, totals, step
    summaries, findings and the agent's events (restart history, speed checks), which
    move into one step-less batch per rank (seq EVENTS_SEQ). Pages of an archived run
    read the summaries (zoomed in, they show bucket envelopes instead of single steps).
    A rank whose summaries do not hold all its steps (stored before summaries existed)
    has them built from its batches first, which reads all of them once; Conflict when
    they cannot be (its batches are gone too), and nothing is dropped. Idempotent; a
    batch with steps sent after archiving is stored as usual and un-archives the run."""
    with writing(session):
        run = get_run(session, run_id)
        ranks = run_ranks(session, run_id)
        for rank_row in ranks:
            _summarise_all_steps(session, rank_row)
        kept = {rank_row.rank: _readable_events(session, run_id, rank_row.rank)
                for rank_row in ranks}
        session.execute(delete(Batch).where(Batch.run_id == run_id))
        session.execute(delete(Fp8Sample).where(Fp8Sample.run_id == run_id))
        session.execute(delete(SpikeSample).where(SpikeSample.run_id == run_id))
        # the combined norms' sums go with the steps they were summed from
        session.execute(delete(CombinedNorms).where(CombinedNorms.run_id == run_id))
        session.execute(delete(CombinedRank).where(CombinedRank.run_id == run_id))
        for rank, events in kept.items():
            if events:
                session.execute(insert(Batch).values(
                    **encode_columns(new_batch_row(run_id, rank, EVENTS_SEQ, [],
                                                   run.n_layers, events))))
        run.archived_at = utcnow()
        session.commit()
        return run


# the seq of an archived rank's events-only batch: below any seq an agent sends (>= 0)
EVENTS_SEQ = -1


def _readable_events(session: Session, run_id: str, rank: int) -> list[dict]:
    """The rank's events as reads see them (a restart's superseded steps take their events
    with them), in the order `load_batches` reads them. Reads only the events column."""
    rows = session.execute(
        select(Batch.events, Batch.superseded_from)
        .where(Batch.run_id == run_id, Batch.rank == rank)
        .order_by(Batch.first_step, Batch.seq)
    ).all()
    return [event for row in rows for event in row.events or []
            if row.superseded_from is None or event.get("step") is None
            or event["step"] < row.superseded_from]


def _summarise_all_steps(session: Session, rank_row: RunRank) -> None:
    """Make the rank's step summaries hold every step it has, from its stored batches."""
    run_id, rank = rank_row.run_id, rank_row.rank
    if summarised_steps(session, run_id, rank) >= rank_row.steps:
        return
    rebuild_summaries(session, run_id, rank)
    held = summarised_steps(session, run_id, rank)
    if held < rank_row.steps:
        session.rollback()
        raise Conflict(f"run {run_id!r} not archived: the step summaries of rank {rank} hold "
                       f"{held:,} of its {rank_row.steps:,} steps and its stored batches "
                       "cannot rebuild the rest; archiving would lose those steps")


def database_bytes(engine: Engine) -> int:
    """Size of the database on disk: SQLite, its file plus its write-ahead log (what the
    file system holds, not the pages in use); Postgres, the database's size."""
    with engine.connect() as conn:
        if engine.dialect.name != "sqlite":
            return int(conn.execute(text("SELECT pg_database_size(current_database())"))
                       .scalar_one())
        files = {row.name: row.file for row in conn.execute(text("PRAGMA database_list"))}
    path = files.get("main")
    if not path:  # an in-memory database
        return 0
    return sum(os.path.getsize(p) for p in (path, f"{path}-wal") if os.path.exists(p))


def compact(engine: Engine, session: Session) -> dict:
    """Hand space freed by deleted or archived runs back to the file system: SQLite
    `VACUUM` (rewrites the database through the write-ahead log, then a TRUNCATE
    checkpoint copies it into the file and empties the log; blocks every writer of this
    process meanwhile, and needs about twice as much free disk as the database holds),
    Postgres `VACUUM` (marks the space reusable; the file shrinks only at its end).
    Returns the on-disk size before and after."""
    before = database_bytes(engine)
    with writing(session), engine.connect().execution_options(
            isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM"))
        if engine.dialect.name == "sqlite":
            # without it the rewritten pages sit in the -wal file, which then outgrows
            # what VACUUM freed, until some later checkpoint
            conn.execute(text("PRAGMA wal_checkpoint(TRUNCATE)"))
    return {"dialect": engine.dialect.name, "bytes_before": before,
            "bytes_after": database_bytes(engine)}
