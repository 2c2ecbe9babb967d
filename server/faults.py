"""Database faults made visible: a full disk is a 507 with the reason, an unreachable or
broken database a 503, /api/v1/health says the database is degraded, and on SQLite a
write is never acknowledged when the database file was deleted or replaced under us."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sqlalchemy.exc import OperationalError, TimeoutError

from ampwatch.server.errors import AmpwatchServerError

DISK_FULL_SQLSTATE = "53100"


class DatabaseUnavailable(AmpwatchServerError):
    status_code = 503


class DatabaseBusy(DatabaseUnavailable):
    """Every pooled connection stayed taken for the pool's timeout: the database is
    behind; retry in `retry_after` seconds."""

    retry_after = 1


class DiskFull(AmpwatchServerError):
    status_code = 507
    PREFIX = "the database's disk is full"


class DatabaseHealth:
    """The last write failure of this process, until a write succeeds again (a full disk
    leaves SELECT 1 working, so probing alone would report it healthy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failure: str | None = None

    def failed(self, reason: str) -> None:
        with self._lock:
            self.failure = reason

    def wrote(self) -> None:
        if self.failure is not None:
            with self._lock:
                self.failure = None


class SqliteFileWatch:
    """Notices that the SQLite file was deleted or replaced while the server runs: open
    connections keep writing to the unlinked file, so every later write would be lost.
    `check` costs one stat()."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.identity = self._identity()

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def check(self) -> None:
        if self.identity is None:
            self.identity = self._identity()
            return
        if self._identity() != self.identity:
            raise DatabaseUnavailable(
                f"the database file {self.path} was deleted or replaced while the server "
                "ran; nothing is stored until the server is restarted")


def database_error(exc: Exception) -> AmpwatchServerError:
    """The domain error for a driver failure: DiskFull (507) or DatabaseUnavailable (503),
    with a one-line reason (never a statement or its parameters)."""
    if isinstance(exc, TimeoutError):
        return DatabaseBusy("all database connections are busy; retry")
    reason = first_line(exc)
    sqlstate = getattr(getattr(exc, "orig", exc), "sqlstate", None)
    if sqlstate == DISK_FULL_SQLSTATE or "disk is full" in reason:
        return DiskFull(f"{DiskFull.PREFIX}: {reason}")
    return DatabaseUnavailable(f"database error: {reason}")


def first_line(exc: Exception, limit: int = 200) -> str:
    """The first line of a driver error (its DBAPI original when wrapped), never the
    statement or its parameters; the type's name when the message is empty."""
    original = getattr(exc, "orig", None) or exc
    return (str(original).strip().splitlines() or [type(original).__name__])[0][:limit]


DATABASE_ERRORS = (OperationalError, TimeoutError)
