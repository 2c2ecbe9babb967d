"""`ampwatch serve`, `ampwatch worker` and `ampwatch db upgrade`, registered into the ampwatch CLI
through the `ampwatch.cli` entry point (client/ never imports server/)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from pydantic import ValidationError


def register(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="run the ampwatch server",
        description="Serve the REST API (/api/v1, described at /docs), the dashboard pages "
                    "and ingest from agents. Migrates the database on start. Flags win over "
                    "the AMPWATCH_* environment; see docs/server.md for every setting.")
    serve.add_argument("--host", help="bind address (AMPWATCH_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (AMPWATCH_PORT, default 8000)")
    serve.add_argument("--database-url",
                       help="sqlite:///PATH or postgresql+psycopg://... (AMPWATCH_DATABASE_URL, "
                            "default SQLite in $XDG_DATA_HOME/ampwatch, i.e. "
                            "~/.local/share/ampwatch)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default %(default)s)")
    # `ampwatch demo` starts its server with this: a demo killed by SIGKILL cannot stop it
    serve.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    worker = commands.add_parser(
        "worker", help="run an analysis worker",
        description="Judge stored batches with the detectors: drain the analysis queue "
                    "that servers fill. Run any number beside any number of servers on one "
                    "Postgres (each run's batches are judged in order by one worker at a "
                    "time); servers run one as a thread too unless AMPWATCH_EMBEDDED_WORKER=0. "
                    "Stops on SIGTERM or Ctrl-C after the batches in hand.")
    worker.add_argument("--database-url", help="as for serve (AMPWATCH_DATABASE_URL)")
    worker.add_argument("--poll", type=float, default=1.0, metavar="SECONDS",
                        help="how often an idle worker looks for work (default %(default)s)")
    worker.add_argument("--claim", type=int, default=None, metavar="BATCHES",
                        help="batches of one run judged per transaction (default 64; 4 on "
                             "SQLite)")
    worker.set_defaults(func=_worker)

    db = commands.add_parser("db", help="database schema commands",
                             description="Database schema commands (Alembic migrations).")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    up = db_commands.add_parser(
        "upgrade", help="apply pending migrations and exit",
        description="Apply the pending schema migrations to the database and exit "
                    "(`ampwatch serve` does this on start too).")
    up.add_argument("--database-url", help="as for serve (AMPWATCH_DATABASE_URL)")
    up.set_defaults(func=_db_upgrade)


def _settings(args: argparse.Namespace):
    from ampwatch.server.settings import Settings

    overrides = {k: v for k in ("host", "port", "database_url")
                 if (v := getattr(args, k, None)) is not None}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        sys.exit(f"ampwatch: invalid settings: {errors}")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ampwatch.server.app import create_app
    from ampwatch.server.serving import bind_listener, limit_malloc_arenas, uvicorn_options

    settings = _settings(args)
    # the port first: one in use is told before anything starts or a database is made
    try:
        listener = bind_listener(settings.host, settings.port)
    except OSError as exc:
        why = ("is in use (is another server running? choose one with --port)"
               if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror}")
        print(f"ampwatch: port {settings.port} on {settings.host} {why}", file=sys.stderr)
        return 1
    limit_malloc_arenas()  # before any thread allocates
    with _clear_database_errors(settings):
        app = create_app(settings)
    print(f"ampwatch: serving on http://{settings.host}:{settings.port} "
          f"(database {_display_url(settings.database_url)})", flush=True)
    if settings.alerts.targets:
        targets = ", ".join(f"{name} {target.redacted_url}"
                            for name, target in settings.alerts.targets.items())
        print(f"ampwatch: alerts: {len(settings.alerts.rules)} rules; targets {targets}",
              flush=True)
    # connections beyond this get uvicorn's 503: room for idle keep-alive connections on
    # top of the requests the app itself admits (RequestSlotMiddleware)
    options = uvicorn_options(settings.header_timeout_s, settings.send_timeout_s,
                              max_connections=settings.max_concurrent_requests * 8 + 64)
    if args.exit_with_parent:
        _exit_when_orphaned(os.getppid())
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=args.log_level, **options)
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def _exit_when_orphaned(parent: int, poll_s: float = 1.0) -> None:
    """Shut this server down cleanly (SIGTERM to itself, which uvicorn handles) once the
    process `parent` is gone: the parent PID changes when it dies. Checks every `poll_s`
    on a daemon thread."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ampwatch-parent-watch", daemon=True).start()


def _worker(args: argparse.Namespace) -> int:
    from ampwatch.server.db import make_engine, upgrade
    from ampwatch.server.worker.analysis_worker import run_worker

    if args.poll <= 0 or (args.claim is not None and args.claim < 1):
        sys.exit("ampwatch: --poll must be above 0 and --claim at least 1")
    settings = _settings(args)
    with _clear_database_errors(settings):
        if settings.migrate_on_start:
            engine = make_engine(settings.database_url)
            upgrade(engine)
            engine.dispose()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ampwatch: analysis worker on {_display_url(settings.database_url)}", flush=True)
    judged = run_worker(settings, stop, poll_s=args.poll, claim_size=args.claim)
    print(f"ampwatch: analysis worker stopped after {judged} batches", flush=True)
    return 0


def _db_upgrade(args: argparse.Namespace) -> int:
    from ampwatch.server.db import make_engine, upgrade

    settings = _settings(args)
    with _clear_database_errors(settings):
        engine = make_engine(settings.database_url)
        upgrade(engine)
        engine.dispose()
    print(f"ampwatch: database at {_display_url(settings.database_url)} is up to date")
    return 0


@contextlib.contextmanager
def _clear_database_errors(settings) -> Iterator[None]:
    """A database that cannot be opened or migrated ends the command with one line (what
    and why), not a traceback."""
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from ampwatch.server.faults import first_line

    try:
        yield
    except (SQLAlchemyError, CommandError, OSError) as exc:
        reason = first_line(exc, 300)
        if isinstance(exc, CommandError) and "revision" in reason:
            reason += " (a newer ampwatch wrote this database: upgrade ampwatch)"
        sys.exit(f"ampwatch: cannot use the database at "
                 f"{_display_url(settings.database_url)}: {reason}")


def _display_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
