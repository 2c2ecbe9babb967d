"""The processes bench/scale_sim.py measures: a database of its own, two `ampwatch serve`
processes on it, and one `ampwatch worker` that can be slowed, killed and restarted."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from ranks import drop_database, free_port, fresh_database, layer_table
from scale_probes import READER_APP, PostgresProbe, QueueProbe, cpu_seconds

AMPWATCH = [sys.executable, "-m", "ampwatch.client.cli"]
SLOW_RUN_S, SLOW_PERIOD_S = 0.01, 0.1  # the slowed worker runs 10 ms of every 100 ms


def has_worker_command() -> bool:
    """Whether this ampwatch has `ampwatch worker` (detection off the request path)."""
    return subprocess.run([*AMPWATCH, "worker", "--help"], capture_output=True).returncode == 0


def start_serve(database_url: str, embedded_worker: bool) -> tuple[subprocess.Popen, str]:
    """`ampwatch serve` on a free loopback port, once its health answers;
    `embedded_worker=False` keeps detection out of it (AMPWATCH_EMBEDDED_WORKER=0)."""
    port = free_port()
    env = {**os.environ, "AMPWATCH_EMBEDDED_WORKER": "true" if embedded_worker else "false"}
    proc = subprocess.Popen([*AMPWATCH, "serve", "--database-url", database_url, "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"ampwatch serve did not start (exit {proc.poll()})")


class Worker:
    """One `ampwatch worker` process in a session of its own (signals reach all of it)."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.proc: subprocess.Popen | None = None
        self.spent = 0.0  # CPU seconds of killed processes

    def cpu(self) -> float:
        """CPU seconds of every worker process started so far."""
        return self.spent + (cpu_seconds(self.pid) if self.pid is not None else 0.0)

    def start(self) -> None:
        self.proc = subprocess.Popen([*AMPWATCH, "worker", "--database-url", self.database_url],
                                     stdout=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def signal(self, sig: int) -> None:
        if self.pid is not None:
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        self.spent = self.cpu()
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    @contextlib.contextmanager
    def slowed(self):
        """Runs the worker SLOW_RUN_S of every SLOW_PERIOD_S: a tenth of its speed."""
        done = threading.Event()

        def duty_cycle() -> None:
            while not done.is_set():
                self.signal(signal.SIGCONT)
                time.sleep(SLOW_RUN_S)
                self.signal(signal.SIGSTOP)
                time.sleep(SLOW_PERIOD_S - SLOW_RUN_S)
            self.signal(signal.SIGCONT)

        thread = threading.Thread(target=duty_cycle, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


class Cluster:
    """The database, two servers and the worker that every phase shares."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.database_url = fresh_database(args.postgres, prefix="ampwatch_scale")
        self.dsn = self.database_url.replace("+psycopg", "")
        self.database = self.database_url.rsplit("/", 1)[1]
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []  # the ingest servers the senders post to
        self.reader: subprocess.Popen | None = None
        self.reader_url: str | None = None  # where the page and /metrics probes read
        self.worker: Worker | None = None

    def start(self) -> None:
        worker = not self.args.no_worker and has_worker_command()
        for _ in range(self.args.servers):  # one after the other: the first migrates
            proc, url = start_serve(self.database_url, self.args.embedded_workers or not worker)
            self.procs.append(proc)
            self.urls.append(url)
        if self.args.reader:  # a replica that only serves pages: their CPU is its own
            self.reader, self.reader_url = start_serve(
                f"{self.database_url}?application_name={READER_APP}", False)
        else:
            self.reader_url = self.urls[-1]
        if worker:
            self.worker = Worker(self.database_url)
            self.worker.start()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        for proc in [*self.procs, *([self.reader] if self.reader else [])]:
            proc.terminate()
            proc.wait(timeout=30)
        drop_database(self.args.postgres, self.database_url)

    def cpu(self, pg: PostgresProbe) -> dict[str, float]:
        return {"servers": sum(cpu_seconds(p.pid) for p in self.procs),
                "reader": cpu_seconds(self.reader.pid) if self.reader else 0.0,
                "worker": self.worker.cpu() if self.worker is not None else 0.0,
                **{f"pg{pid}": s for pid, s in pg.backend_cpu().items()}}

    def register(self, run_ids: list[str], ranks: int) -> None:
        layers = layer_table(self.args.layers)
        with httpx.Client(base_url=self.urls[0], timeout=120) as client:
            for run_id in run_ids:
                client.put(f"/api/v1/runs/{run_id}", json={
                    "name": run_id, "layers": layers, "environment": {
                        "world_size": ranks, "grad_layout": self.args.layout,
                        "parallelism": "fsdp2" if self.args.layout == "sharded" else "ddp",
                    }}).raise_for_status()

    def drain(self, timeout: float) -> float | None:
        """Seconds until the analysis queue is empty (None: not within `timeout`)."""
        t0 = time.monotonic()
        probe = QueueProbe(self.reader_url)
        try:
            while time.monotonic() - t0 < timeout:
                with contextlib.suppress(httpx.HTTPError):
                    if not probe.read()[0]:  # empty, or no queue at all
                        return time.monotonic() - t0
                time.sleep(0.5)
            return None
        finally:
            probe.client.close()


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two `Cluster.cpu` readings: servers, worker, and the database's
    backends (one that started in between counts from zero)."""
    pg = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith("pg"))
    return {"servers": after["servers"] - before["servers"],
            "reader": after["reader"] - before["reader"],
            "worker": after["worker"] - before["worker"], "postgres": pg}
