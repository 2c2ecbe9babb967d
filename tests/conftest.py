"""Shared fixtures: a real app on a real database (a temp SQLite file, and Postgres
when AMPWATCH_TEST_POSTGRES_URL is set), a real HTTP client, a live server process."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from tests.utils import ANALYSIS_WAIT_S

if not torch.cuda.is_available():
    # the device path's flagged checks run their Triton kernel in Triton's interpreter on
    # the CPU (agent/collectors/flagged_checks.py): set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _quiet_nanobind_at_exit() -> None:
    """Triton's nanobind extension lists about 30 lines of "nanobind: leaked" objects on
    stderr as the interpreter finalizes (its functions and types are still referenced
    then; nothing leaks while tests run). nanobind's switch for it, set_leak_warnings, is
    C++ only and triton exposes none, so once triton was imported stderr goes to
    /dev/null for the interpreter's last moments. Registered first, so it runs after
    every other exit handler (the agent's flushes keep their stderr)."""
    if "triton._C.libtriton" in sys.modules:
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


atexit.register(_quiet_nanobind_at_exit)

POSTGRES_URL = os.environ.get("AMPWATCH_TEST_POSTGRES_URL")
NO_POSTGRES = "AMPWATCH_TEST_POSTGRES_URL is not set (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test)"


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Data, cache and agent spool dirs of this test session, never the user's: an agent
    replays the leftovers it finds in its spool root, so a shared one would carry one
    session's batches into another session's server. Session-scoped so that module- and
    session-scoped fixtures that train are covered too."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMPWATCH_SPOOL_DIR", str(home / "spool"))
        patch.setenv("XDG_CACHE_HOME", str(home / "cache"))
        patch.setenv("XDG_DATA_HOME", str(home / "data"))
        # TestClient's requests name the host "testserver": a server without a token
        # answers only names it trusts (DNS rebinding); tests of that name others
        patch.setenv("AMPWATCH_ALLOWED_HOSTS", "testserver")
        yield home


@pytest.fixture(autouse=True)
def private_spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """And a spool of its own for each test, so no test replays another's leftovers."""
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path / "spool"))


# FastAPI keeps every endpoint and dependency callable it classifies in module-level LRU
# caches (4,096 entries each, fastapi/dependencies/models.py); FastAPIOffline's docs
# endpoints close over their app, so each test's app (about 4 MB: routes, response
# models, the OpenAPI schema) stayed alive until 4,096 newer callables pushed it out:
# about 2 GB by the end of the suite.
FASTAPI_CALLABLE_CACHES = ("_is_gen_callable_cached", "_is_async_gen_callable_cached",
                           "_is_coroutine_callable_cached")


def release_fastapi_callables() -> None:
    """Drop FastAPI's cached references to the callables of the apps made so far; a later
    app fills the caches again (they only save it work while it is built)."""
    from fastapi.dependencies import models

    for name in FASTAPI_CALLABLE_CACHES:
        cached = getattr(models, name, None)
        if cached is not None:
            cached.cache_clear()


@pytest.fixture(autouse=True)
def _apps_do_not_outlive_their_test() -> Iterator[None]:
    yield
    release_fastapi_callables()


def postgres_admin() -> Engine:
    """An AUTOCOMMIT engine on the test Postgres server's own database, for CREATE and
    DROP DATABASE (skips without a test Postgres; the caller disposes it)."""
    if not POSTGRES_URL:
        pytest.skip(NO_POSTGRES)
    return create_engine(make_url(POSTGRES_URL).set(drivername="postgresql+psycopg"),
                         isolation_level="AUTOCOMMIT")


def drop_postgres(admin: Engine, name: str) -> None:
    """Drop database `name`, ending any session still connected to it."""
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    """A fresh database on the test Postgres server for this test session, dropped after."""
    admin = postgres_admin()
    name = f"ampwatch_test_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        drop_postgres(admin, name)
        admin.dispose()


@contextmanager
def postgres_copy(url: str) -> Iterator[str]:
    """A copy of the test database at `url`, dropped after the block. The caller has
    closed its own connections to `url`; a closed client's backend can outlive it for a
    moment under load, so the sessions still there are ended first (for up to 10 s)."""
    admin = postgres_admin()
    source = make_url(url)
    name = f"{source.database}_copy_{uuid.uuid4().hex[:6]}"
    try:
        with admin.connect() as conn:
            for _ in range(20):
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = :db AND pid <> pg_backend_pid()"),
                             {"db": source.database})
                try:
                    conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{source.database}"'))
                    break
                except OperationalError:  # ObjectInUse: a session was still leaving
                    time.sleep(0.5)
            else:
                raise AssertionError(f"{source.database} stayed in use: no copy")
        yield source.set(database=name).render_as_string(hide_password=False)
    finally:
        drop_postgres(admin, name)
        admin.dispose()


def empty_postgres(url: str) -> None:
    """Empty every table of the test database (the schema and migrations stay)."""
    engine = create_engine(url)
    with engine.begin() as conn:
        tables = conn.execute(text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
            "AND tablename <> 'alembic_version'"
        )).scalars().all()
        if tables:
            conn.execute(text("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " CASCADE"))
    engine.dispose()


def fresh_database_url(request: pytest.FixtureRequest, backend: str, directory: Path) -> str:
    """An empty database: "sqlite", a new file in `directory`; "postgres", the session's
    test database emptied (skips without a test Postgres). For fixtures of any scope."""
    if backend == "sqlite":
        return f"sqlite:///{directory / 'ampwatch.db'}"
    url = request.getfixturevalue("postgres_database")
    empty_postgres(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test using this runs once on SQLite and once on Postgres."""
    return fresh_database_url(request, request.param, tmp_path)


@pytest.fixture
def settings(database_url: str):
    from ampwatch.server.settings import Settings

    return Settings(database_url=database_url)


@pytest.fixture
def app(settings):
    from ampwatch.server.app import close_app, create_app

    app = create_app(settings)
    yield app
    close_app(app)


def judged_client(app, **kwargs):
    """A real HTTP client (httpx over ASGI, FastAPI's TestClient) on `app`; each request
    returns once the app's analysis worker has judged what it stored, so a test reads
    the findings of what it posted, from the API or the database."""
    from fastapi.testclient import TestClient

    class JudgedClient(TestClient):
        def request(self, *args, **kw):
            response = super().request(*args, **kw)
            worker = app.state.analysis_worker
            if worker is not None:
                assert worker.wait_idle(30), "the analysis worker did not finish in 30 s"
            return response

    return JudgedClient(app, **kwargs)


@pytest.fixture
def api(app):
    """A real HTTP client on the real app (`judged_client`)."""
    with judged_client(app, raise_server_exceptions=True) as client:
        yield client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """`ampwatch serve` in a child process on a free port; stop/start keep the database."""

    def __init__(self, database_url: str, log_path: Path, env: dict | None = None) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ampwatch.client.cli", "serve", "--port", str(self.port),
                 "--database-url", self.database_url, "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.log_path.read_text()[-2000:]}")

    def wait_for_analysis(self, run_id: str | None = None,
                          timeout: float = ANALYSIS_WAIT_S) -> None:
        """Return once the server has judged every batch it stored, of `run_id` or of
        every run: what a user's script does before it reads findings
        (`Client.wait_for_analysis`); for fixtures that seed runs before their tests read."""
        from ampwatch.client import Client

        with Client(self.url, timeout=timeout + 10) as client:
            if run_id is not None:
                client.wait_for_analysis(run_id, timeout)
                return
            # the read waits for every run's queue to drain, at most a minute a request
            deadline = time.monotonic() + timeout
            while pending := sum(run.analysis_pending
                                 for run in client.runs(wait=min(timeout, 60))):
                assert time.monotonic() < deadline, f"analysis of {pending} batches pending"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def module_server(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[LiveServer]:
    """A live server on a SQLite file of its own, for module- and session-scoped fixtures
    (`yield from module_server(tmp_path_factory, "faults")`)."""
    root = tmp_path_factory.mktemp(name)
    live = LiveServer(f"sqlite:///{root / f'{name}.db'}", root / "server.log")
    live.start(timeout=120)  # a loaded CI machine can take a while to import the server
    yield live
    live.stop()


@contextmanager
def agent_errors_fail() -> Iterator[list[tuple[str, BaseException]]]:
    """What the agent's error boundary swallowed inside the block (it never raises into training);
    the first one fails the test."""
    from ampwatch.agent import errors  # imports torch: only the tests that train call this

    swallowed: list[tuple[str, BaseException]] = []
    errors.set_error_handler(lambda site, exc: swallowed.append((site, exc)))
    try:
        yield swallowed
    finally:
        errors.set_error_handler(None)
    if swallowed:
        site, exc = swallowed[0]
        raise AssertionError(f"agent swallowed an error in {site}") from exc


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A real server process on 127.0.0.1 with its own SQLite file; `.url` is its base URL."""
    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log")
    server.start()
    yield server
    server.stop()


NO_CUDA = "no CUDA device here: a -m cuda test (docs/gpu.md says how and where they run)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `cuda` tests without a CUDA device, saying so (torch is imported only when
    such a test was collected)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session is over and the interpreter exits next: its final garbage collections
    would walk every object the suite left behind (module-scoped data, caches; all of it
    freed with the process anyway); frozen, they are skipped."""
    gc.freeze()
