"""Alembic migrations build the schema the models describe, on SQLite and Postgres."""

from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from ampwatch.server.db import make_engine, upgrade
from ampwatch.server.models import Base


def test_upgrade_from_empty_matches_the_models(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    upgrade(engine)  # idempotent
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert {"runs", "layers", "run_ranks", "batches", "findings", "alembic_version"} <= tables


def test_db_upgrade_command(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    done = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "db", "upgrade",
                           "--database-url", url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
    engine = make_engine(url)
    assert "runs" in inspect(engine).get_table_names()
    engine.dispose()


def test_bad_database_url_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "db", "upgrade",
                           "--database-url", "mysql://x"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "database_url" in done.stderr and "Traceback" not in done.stderr
