"""Engines and schema migration. The engine is made by `create_app` from settings."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Executable, Row, bindparam, create_engine, event, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.faults import DatabaseHealth, SqliteFileWatch, database_error

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(database_url: str) -> Engine:
    """An engine tuned for the backend: SQLite in WAL mode with a busy timeout, so
    concurrent ingest requests wait for the write lock instead of failing."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=8
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            cur = dbapi_connection.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


def session_info(engine: Engine, health: DatabaseHealth) -> dict:
    """What every session of `engine` carries: the process's `DatabaseHealth` (a write
    failure degrades it, `health_on_commit` clears it when a commit succeeds); on SQLite
    also a process-wide `write_lock` that ingest takes, so concurrent writers queue in
    order instead of polling SQLite's busy handler (whose sleeps gave p99 latencies of
    seconds with 8 senders), and a watch on the database file."""
    info: dict = {"health": health}
    if engine.dialect.name == "sqlite":
        info["write_lock"] = threading.Lock()
        if engine.url.database and engine.url.database != ":memory:":
            info["file_watch"] = SqliteFileWatch(engine.url.database)
    return info


def health_on_commit(maker: sessionmaker, health: DatabaseHealth) -> None:
    """A commit that succeeded wrote: the database takes writes again."""
    event.listen(maker, "after_commit", lambda _session: health.wrote())


@contextlib.contextmanager
def writing(session: Session) -> Iterator[None]:
    """Hold while a transaction writes: the SQLite write lock of `session_info`, nothing
    on Postgres. Every write path (ingest, register, delete) takes it, so this process's
    writers queue in order instead of polling SQLite's busy handler. On SQLite, raises
    DatabaseUnavailable before and after the write when the database file is gone, so
    a write to a deleted file is never acknowledged. A driver failure while writing (a
    full disk, a read-only database) degrades the process's `DatabaseHealth`; the next
    commit that succeeds (see `session_info`) restores it."""
    watch = session.info.get("file_watch")
    with session.info.get("write_lock") or contextlib.nullcontext():
        if watch is not None:
            watch.check()
        try:
            yield
        except OperationalError as exc:
            if "health" in session.info:
                session.info["health"].failed(database_error(exc).message)
            raise
        if watch is not None:
            watch.check()


def dialect_insert(session: Session, table: type) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT, which has `on_conflict_do_nothing` and `on_conflict_do_update`
    (SQLite and Postgres)."""
    return _insert_of(session.get_bind().dialect.name)(table)


def _insert_of(dialect: str) -> Callable:
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


class PerDialect:
    """A statement built once for each dialect (`build` gets its `insert`) and reused. On
    the paths that run for every batch, building a statement and its cache key cost more
    than executing it; a reused one binds its values at execute."""

    def __init__(self, build: Callable[[Callable], Executable]) -> None:
        self._build = build
        self._built: dict[str, Executable] = {}

    def __call__(self, session: Session) -> Executable:
        name = session.get_bind().dialect.name
        statement = self._built.get(name)
        if statement is None:
            statement = self._built[name] = self._build(_insert_of(name))
        return statement


INT64_MAX = 2**63 - 1


class StepPages:
    """One rank's rows of a per-step table (`run_id`, `rank`, `step` columns) with
    start <= step <= end, in step order, `per_query` rows a query (keyset paging: a
    server-side cursor would hold a Postgres connection as long). The statement is built
    once: the analysis reads a rank's samples for every batch it judges."""

    def __init__(self, table: type, columns: tuple) -> None:
        step = table.step
        self.statement = (select(*columns)
                          .where(table.run_id == bindparam("run_id"),
                                 table.rank == bindparam("rank"),
                                 step > bindparam("after"), step <= bindparam("end"))
                          .order_by(step).limit(bindparam("per_query")))

    def rows(self, session: Session, run_id: str, rank: int, start: int | None,
             end: int | None, per_query: int) -> Iterator[Row]:
        params = {"run_id": run_id, "rank": rank, "per_query": per_query,
                  "after": -INT64_MAX if start is None else start - 1,
                  "end": INT64_MAX if end is None else end}
        while True:
            rows = session.execute(self.statement, params).all()
            yield from rows
            if len(rows) < per_query:
                return
            params["after"] = rows[-1].step


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine) -> None:
    """Apply every Alembic migration not yet applied (idempotent)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
