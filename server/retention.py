"""Retention: archiving a run (its full-resolution data dropped, its step summaries,
findings and totals kept) and handing freed space back to the file system."""

from __future__ import annotations

from sqlalchemy import delete, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from ampwatch.server.db import writing
from ampwatch.server.models import Batch, Fp8Sample, Run, utcnow
from ampwatch.server.runs import get_run


def archive_run(session: Session, run_id: str) -> Run:
    """Drop the run's stored batches and FP8 samples; keep the run, its layers, totals,
    step summaries and findings. Pages of an archived run read the summaries (zoomed in,
    they show bucket envelopes instead of single steps). Idempotent; a batch sent after
    archiving is stored as usual."""
    with writing(session):
        run = get_run(session, run_id)
        session.execute(delete(Batch).where(Batch.run_id == run_id))
        session.execute(delete(Fp8Sample).where(Fp8Sample.run_id == run_id))
        run.archived_at = utcnow()
        session.commit()
        return run


def database_bytes(engine: Engine) -> int:
    """Size of the database on disk (SQLite: pages in use by the file; Postgres: the
    database's size)."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            pages = conn.execute(text("PRAGMA page_count")).scalar_one()
            return int(pages) * int(conn.execute(text("PRAGMA page_size")).scalar_one())
        return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one())


def compact(engine: Engine, session: Session) -> dict:
    """Hand space freed by deleted or archived runs back to the file system: SQLite
    `VACUUM` (rewrites the file; blocks writers of this process meanwhile, and needs as
    much free disk as the database holds), Postgres `VACUUM` (marks the space reusable;
    the file shrinks only at its end). Returns the size before and after."""
    before = database_bytes(engine)
    with writing(session), engine.connect().execution_options(
            isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM"))
    return {"dialect": engine.dialect.name, "bytes_before": before,
            "bytes_after": database_bytes(engine)}
