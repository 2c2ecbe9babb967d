"""`ampwatch demo`: start a server on its embedded SQLite (or use a running one), train the
demo runs of demo/runs.py on the CPU with the agent attached, and print the
dashboard URL with a verdict per run.

Registered into the ampwatch CLI through the `ampwatch.cli` entry point. The server is a
child process (`ampwatch serve`), stopped by its PID: agent/ never imports server/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ampwatch.client.api import Client
from ampwatch.client.errors import AmpwatchError
from ampwatch.client.models import Finding
from ampwatch.demo import alerts as demo_alerts
from ampwatch.wire import DEFAULT_SERVER

DEFAULT_PORT = urlsplit(DEFAULT_SERVER).port
DEFAULT_STEPS = 500
MIN_STEPS = 60  # the overflow starts a third of the way in, after the scaler calibrated
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
ANALYSIS_WAIT_S = 30.0  # the summary waits this long at most for the findings of a run
LOG_TAIL_CHARS = 2000
ERROR_EXIT = 2


class DemoFailed(Exception):
    """Why the demo cannot go on, in one line for the user."""


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="train a few small runs on the CPU and show them on the dashboard",
        description="Start a server (or use a running one), train four small runs on the "
                    "CPU with the agent attached (healthy fp16, a diverging scaler, "
                    "misaligned layers with a loop pitfall, bf16) and print their URLs. Safe to "
                    "re-run: the runs of earlier demos are kept, and each re-run adds four "
                    "new ones (ids ending in -2, -3, ...).")
    demo.add_argument("--server", metavar="URL",
                      help="use this running server instead of starting one (default "
                           "$AMPWATCH_SERVER when set and neither --port nor --database-url "
                           "is given)")
    demo.add_argument("--port", type=int,
                      help=f"port of the server the demo starts (default {DEFAULT_PORT}; "
                           "without --port and --database-url a server already healthy "
                           "there is used)")
    demo.add_argument("--database-url",
                      help="database of the server the demo starts "
                           f"(default {default_database_url()})")
    demo.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                      help="optimizer steps per run (default %(default)s)")
    demo.add_argument("--keep-serving", action="store_true",
                      help="leave the server the demo started up until Ctrl-C (or SIGTERM)")
    demo.set_defaults(func=_demo)


def default_database_url() -> str:
    """sqlite:/// on `$XDG_DATA_HOME/ampwatch/demo.db` (~/.local/share/ampwatch/demo.db)."""
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return f"sqlite:///{Path(data) / 'ampwatch' / 'demo.db'}"


class ServerProcess:
    """`ampwatch serve` in a child process (its own session, so Ctrl-C reaches only the
    demo, which then stops it by PID; a demo killed outright leaves no server behind: it
    exits with its parent)."""

    def __init__(self, port: int, database_url: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.env = {**os.environ, **(env or {})}
        self.database_url = database_url
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it and wait until /api/v1/health answers; blocks up to START_TIMEOUT_S."""
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ampwatch.client.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), "--database-url", self.database_url,
                 "--log-level", "warning", "--exit-with-parent"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DemoFailed(f"the server exited with status {self.process.returncode}; "
                                 f"its log ends with:\n{self.log_tail()}")
            if healthy(self.url):
                return
            time.sleep(0.2)
        self.stop()
        raise DemoFailed(f"the server did not answer within {START_TIMEOUT_S:g} s; "
                         f"its log ends with:\n{self.log_tail()}")

    def wait(self) -> None:
        """Block until the server exits."""
        if self.process is not None:
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down cleanly), SIGKILL after STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:].rstrip()


def healthy(url: str) -> bool:
    """Whether an ampwatch server answers its health check at `url`."""
    try:
        with Client(url, timeout=2.0) as client:
            return client.health().status == "ok"
    except AmpwatchError:
        return False


def port_free(port: int) -> bool:
    """Whether 127.0.0.1:`port` can be bound (with SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _display_url(url: str) -> str:
    """`url` with its password hidden."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _sqlite_path(database_url: str) -> Path | None:
    prefix = "sqlite:///"
    return Path(database_url[len(prefix):]) if database_url.startswith(prefix) else None


def _server(args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack,
            env: dict[str, str]) -> tuple[str, ServerProcess | None]:
    """The base URL to use and the server process the demo started with `env` (None when
    it uses a running one)."""
    # like every other command, $AMPWATCH_SERVER names the server, unless the demo is
    # told to start its own (--port, --database-url)
    server = args.server or (os.environ.get("AMPWATCH_SERVER")
                             if args.port is None and args.database_url is None else None)
    if server:
        url = server.rstrip("/")
        if not healthy(url):
            raise DemoFailed(f"no ampwatch server answers at {url}")
        print(f"ampwatch demo: using the server at {url}", flush=True)
        return url, None
    if args.port is None and args.database_url is None and healthy(DEFAULT_SERVER):
        print(f"ampwatch demo: using the server already running at {DEFAULT_SERVER}",
              flush=True)
        return DEFAULT_SERVER, None
    port = args.port or DEFAULT_PORT
    if not port_free(port):
        raise DemoFailed(f"port {port} on 127.0.0.1 is in use: pass --port N for another "
                         "one, or --server URL to use a running ampwatch server")
    database_url = args.database_url or default_database_url()
    if args.database_url is None:
        _sqlite_path(database_url).parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(port, database_url, workdir / "server.log", env)
    print(f"ampwatch demo: starting the server on {server.url} "
          f"(database {_display_url(database_url)})", flush=True)
    stack.callback(server.stop)
    server.start()
    return server.url, server


def _demo(args: argparse.Namespace) -> int:
    if args.steps < MIN_STEPS:
        return _fail(f"--steps must be at least {MIN_STEPS}")
    try:
        from ampwatch.demo import runs as demo_runs
    except ImportError as exc:
        return _fail(f'the demo needs torch ({exc}): pip install "ampwatch[agent]"')
    if threading.current_thread() is threading.main_thread():
        # `kill PID` stops the demo the way Ctrl-C does: with its server
        signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ampwatch-demo-")))
        webhook = demo_alerts.DemoWebhook().start()
        stack.callback(webhook.stop)
        try:
            url, server = _server(args, workdir, stack, webhook.server_env())
        except DemoFailed as exc:
            return _fail(str(exc))
        client = stack.enter_context(Client(url))
        round_ = _next_round(client, demo_runs)
        _train_all(demo_runs, args.steps, url, workdir / "spool", round_)
        _summary(client, url, demo_runs.SCENARIOS, round_)
        if server is None:
            return 0
        demo_alerts.settle(client)
        print(demo_alerts.summary(webhook), flush=True)
        if args.keep_serving:
            print(f"Serving on {url} until Ctrl-C.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.wait()
            print("\nampwatch demo: stopping the server", flush=True)
        server.stop()
        reopen = _display_url(server.database_url)
        where = _sqlite_path(reopen) or reopen
        print(f"The server is stopped; the database is {where}. Reopen it with:\n"
              f"  ampwatch serve --database-url {reopen}", flush=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def round_run_id(run_id: str, round_: int) -> str:
    """The id of a scenario's run in the `round_`-th demo on one server: the first keeps
    the scenario's id, later ones end in `-<round>`."""
    return run_id if round_ == 1 else f"{run_id}-{round_}"


def _next_round(client: Client, demo_runs: ModuleType) -> int:
    """1 + the last demo round the server holds runs of; says that earlier demo runs are
    kept. A re-run never touches them (every round has its own run ids)."""
    ids = {run.id for run in client.runs(project=demo_runs.PROJECT)}
    round_ = 1
    while any(round_run_id(s.run_id, round_) in ids for s in demo_runs.SCENARIOS):
        round_ += 1
    if round_ > 1:
        print(f"ampwatch demo: the server keeps the {len(ids)} runs of earlier demos; "
              f"this is demo {round_}, its run ids end in -{round_}", flush=True)
    return round_


def _train_all(demo_runs: ModuleType, steps: int, url: str, spool_dir: Path,
               round_: int) -> None:
    total = len(demo_runs.SCENARIOS)
    report_every = max(steps // 4, 1)
    for number, scenario in enumerate(demo_runs.SCENARIOS, 1):
        label = f"[{number}/{total}] {scenario.title}"
        print(f"{label}: training {steps} steps", flush=True)

        def report(p: demo_runs.Progress, label: str = label) -> None:
            scale = f"  loss scale {p.loss_scale:g}  skipped {p.skipped}" \
                if p.loss_scale is not None else ""
            print(f"{label}: step {p.step}/{steps}  loss {p.loss:.4g}{scale}", flush=True)

        start = time.monotonic()
        delivered = demo_runs.train(scenario, steps=steps, server=url, spool_dir=spool_dir,
                                    report=report, report_every=report_every,
                                    run_id=round_run_id(scenario.run_id, round_))
        note = "" if delivered else " (some steps did not reach the server)"
        print(f"{label}: done in {time.monotonic() - start:.1f} s{note}", flush=True)


def verdict(status: str, findings: list[Finding]) -> str:
    """One line from a run's health and its open findings: the warning and critical ones,
    worst first, by kind (pitfall code), cause and layer."""
    serious = sorted((f for f in findings if f.severity_rank >= 1),
                     key=lambda f: -f.severity_rank)
    labels: list[str] = []
    for f in serious:
        cause = f.evidence.get("cause")
        label = f.kind + (f" {f.code}" if f.code else "")
        label += f" in {f.layer!r}" if f.layer else ""
        label += f" ({cause})" if cause else ""
        if label not in labels:
            labels.append(label)
    if not labels:
        info = len(findings)
        return f"{status}: no warnings" + (f" ({info} info finding{'s' * (info != 1)})"
                                           if info else "")
    return f"{status}: " + ", ".join(labels)


def _summary(client: Client, url: str, scenarios: Iterable[Any], round_: int) -> None:
    print(f"\nDashboard: {url}/", flush=True)
    for scenario in scenarios:
        # read right after training: first wait for the detectors to judge what it sent
        run = client.run(round_run_id(scenario.run_id, round_), wait=ANALYSIS_WAIT_S)
        findings = list(client.findings(run.id, status="open"))
        print(f"  {scenario.title}\n    {url}/runs/{run.id}\n    {verdict(run.status, findings)}",
              flush=True)


def _fail(message: str) -> int:
    print(f"ampwatch demo: error: {message}", file=sys.stderr)
    return ERROR_EXIT
