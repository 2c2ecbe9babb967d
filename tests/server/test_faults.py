"""Disk and database faults: a full disk is a 507 with the reason and /health degraded; a
deleted SQLite file never gets a write acknowledged; a database the server cannot open
or migrate ends `ampwatch serve` with one line."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, event, text

from tests.conftest import LiveServer
from tests.utils import make_steps, post_batch, register_run

WIDE = 64  # layers: batches of a few hundred KB fill a small disk quickly


def full_after(engine, pages: int):
    """From now on, SQLite connections of `engine` may grow the file to `pages` pages at
    most (SQLite's own "database or disk is full" error, as on a full disk); returns the
    listener, for `event.remove`."""
    @event.listens_for(engine, "connect")
    def _limit(dbapi_connection, _record) -> None:
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

    engine.dispose()
    return _limit


def noisy(steps: list[dict]) -> list[dict]:
    """`steps` with random layer grad norms: they compress to no less than their size, so
    the batch cannot fit in the free pages a full file still has (made steps compress
    to a few pages)."""
    rng = np.random.default_rng(0)
    for step in steps:
        step["layer_grad_norm"] = rng.random(len(step["layer_grad_norm"])).tolist()
    return steps


def test_a_full_database_is_507_and_health_degraded_until_it_has_room(tmp_path):
    from ampwatch.server.app import create_app
    from ampwatch.server.settings import Settings
    from tests.conftest import judged_client

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'full.db'}"))
    engine = app.state.engine
    with judged_client(app) as api:
        register_run(api, "r1", n_layers=WIDE)
        assert post_batch(api, "r1", 0, make_steps(0, 20, WIDE)).status_code == 200
        with engine.connect() as connection:
            pages = connection.execute(text("PRAGMA page_count")).scalar()
        limit = full_after(engine, pages)

        response = post_batch(api, "r1", 1, noisy(make_steps(20, 200, WIDE, sample_every=2)))
        assert response.status_code == 507
        assert "disk is full" in response.json()["detail"]
        health = api.get("/api/v1/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "disk is full" in health.json()["reason"]
        assert api.get("/api/v1/runs/r1").json()["steps"] == 20  # nothing half-stored
        # a replay writes nothing: acknowledged, and the disk is still full
        assert post_batch(api, "r1", 0, make_steps(0, 20, WIDE)).json()["duplicate"]
        assert api.get("/api/v1/health").status_code == 503

        event.remove(engine, "connect", limit)
        engine.dispose()
        assert post_batch(api, "r1", 1, make_steps(20, 200, WIDE, sample_every=2)
                          ).status_code == 200
        assert api.get("/api/v1/health").status_code == 200
        assert api.get("/api/v1/runs/r1").json()["steps"] == 220
    engine.dispose()


@contextlib.contextmanager
def small_file_system(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only); skips the test where it cannot mount."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_real_full_disk_never_gives_5xx_other_than_507(tmp_path):
    with small_file_system(tmp_path / "disk", "1500k") as disk:
        server = LiveServer(f"sqlite:///{disk / 'ampwatch.db'}", tmp_path / "server.log")
        server.start()
        try:
            acked = 0
            codes = []
            with httpx.Client(base_url=server.url, timeout=60) as http:
                register_run(http, "r1", n_layers=WIDE)
                for seq in range(60):
                    response = post_batch(http, "r1", seq, make_steps(seq * 50, 50, WIDE))
                    codes.append(response.status_code)
                    if response.status_code == 200:
                        acked += 50
                    elif response.status_code == 507:
                        break
                assert set(codes) <= {200, 507} and codes[-1] == 507, codes
                assert "disk is full" in response.json()["detail"]
                health = http.get("/api/v1/health")
                assert health.status_code == 503 and "disk is full" in health.json()["reason"]
                stored = http.get("/api/v1/runs/r1/steps", params={"limit": 100_000}).json()
                assert stored["total"] == acked  # everything acknowledged is there
        finally:
            server.stop()


def test_a_deleted_sqlite_file_gets_503_never_an_acknowledgement(tmp_path):
    database = tmp_path / "gone.db"
    server = LiveServer(f"sqlite:///{database}", tmp_path / "server.log")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            register_run(http, "r1", n_layers=4)
            assert post_batch(http, "r1", 0, make_steps(0, 10, 4)).status_code == 200
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{database}{suffix}")
            codes = [post_batch(http, "r1", seq, make_steps(seq * 10, 10, 4)).status_code
                     for seq in range(1, 21)]
            assert codes == [503] * 20
            reply = post_batch(http, "r1", 21, make_steps(210, 10, 4)).json()
            assert "deleted or replaced" in reply["detail"]
            assert http.put("/api/v1/runs/r2", json={"name": "x"}).status_code == 503
            health = http.get("/api/v1/health")
            assert health.status_code == 503 and "deleted" in health.json()["reason"]
    finally:
        server.stop()


def serve_once(database_url: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ampwatch.client.cli", "serve", "--port", "1",
         "--database-url", database_url],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_an_unknown_alembic_revision_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'future.db'}"
    assert subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "db", "upgrade",
                           "--database-url", url], capture_output=True).returncode == 0
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0999_future'"))
    engine.dispose()
    result = serve_once(url, tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("ampwatch: cannot use the database at")
    assert "0999_future" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.postgres
def test_a_read_only_postgres_database_is_one_line(postgres_database, tmp_path):
    from sqlalchemy.engine import make_url

    admin = create_engine(postgres_database, isolation_level="AUTOCOMMIT")
    name = f"{make_url(postgres_database).database}_ro"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
        connection.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
    try:
        result = serve_once(make_url(postgres_database).set(database=name)
                            .render_as_string(hide_password=False), tmp_path)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "read-only" in result.stderr and "Traceback" not in result.stderr


def test_a_read_only_sqlite_file_system_is_one_line(tmp_path):
    with small_file_system(tmp_path / "ro", "1m") as disk:
        (disk / "empty.db").touch()
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True)
        if remount.returncode != 0:
            pytest.skip("cannot remount read-only")
        result = serve_once(f"sqlite:///{disk / 'empty.db'}", tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "readonly" in result.stderr.replace("read-only", "readonly")
