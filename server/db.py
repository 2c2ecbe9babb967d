"""Engines and schema migration. The engine is made by `create_app` from settings."""

from __future__ import annotations

import contextlib
import threading
from contextlib import AbstractContextManager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

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


def session_info(engine: Engine) -> dict:
    """What every session of `engine` carries: on SQLite a process-wide `write_lock` that
    ingest takes, so concurrent writers queue in order instead of polling SQLite's busy
    handler (whose sleeps gave p99 latencies of seconds with 8 senders)."""
    if engine.dialect.name == "sqlite":
        return {"write_lock": threading.Lock()}
    return {}


def writing(session: Session) -> AbstractContextManager:
    """Hold while a transaction writes: the SQLite write lock of `session_info`, nothing
    on Postgres. Every write path (ingest, register, delete) takes it, so this process's
    writers queue in order instead of polling SQLite's busy handler."""
    return session.info.get("write_lock") or contextlib.nullcontext()


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
