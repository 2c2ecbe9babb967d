"""What bench/scale_sim.py watches while a phase runs: the CPU of processes (from /proc),
Postgres lock waits (pg_stat_activity), queue depth and worker lag (GET /metrics), and the
latency of pages read while ingesting. Each sampler is a daemon thread in the bench's own
process; sampling costs one query or request per interval."""

from __future__ import annotations

import os
import statistics
import threading
import time

import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

TICKS = os.sysconf("SC_CLK_TCK")
READER_APP = "ampwatch-scale-reader"  # application_name of the page reader's connections


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Sampler(threading.Thread):
    """Calls `sample()` every `interval` seconds until `stop()`."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


class PostgresProbe(Sampler):
    """Sessions of one database waiting on a heavyweight lock (row, transaction id,
    relation: `wait_event_type = 'Lock'`), and its backends' CPU."""

    QUERY = ("SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), "
             "count(*) FILTER (WHERE state = 'active') FROM pg_stat_activity "
             "WHERE datname = %s AND pid <> pg_backend_pid()")

    def __init__(self, dsn: str, database: str, interval: float = 0.25) -> None:
        super().__init__(interval)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.database = database
        self.waiting: list[int] = []
        self.active: list[int] = []

    def sample(self) -> None:
        waiting, active = self.conn.execute(self.QUERY, (self.database,)).fetchone()
        self.waiting.append(waiting)
        self.active.append(active)

    def backend_cpu(self) -> dict[int, float]:
        """CPU seconds of the database's backends, but the page reader's (its connections
        name themselves READER_APP)."""
        pids = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND "
                                 "application_name IS DISTINCT FROM %s",
                                 (self.database, READER_APP)).fetchall()
        return {pid: cpu_seconds(pid) for (pid,) in pids}

    def summary(self) -> dict:
        n = len(self.waiting) or 1
        return {"lock_wait_mean": sum(self.waiting) / n,
                "lock_wait_max": max(self.waiting, default=0),
                "lock_wait_share": sum(1 for w in self.waiting if w) / n,
                "active_mean": sum(self.active) / n}

    def stop(self) -> None:
        super().stop()
        self.conn.close()


DEPTH_WORDS = ("queue", "backlog", "pending")


def queue_figures(text: str) -> tuple[float | None, float | None]:
    """(analysis queue depth, worker lag in seconds) from a /metrics answer: the analysis,
    worker or queue gauges whose names say so (`*queue*|*backlog*|*pending*`, summed over
    labels; `*lag*`, the largest); None where the server exports none. Before the
    queue, `ampwatch_analysis_backlog_batches` is the ingest requests in flight."""
    depth = lag = None
    for family in text_string_to_metric_families(text):
        name = family.name.lower()
        values = [s.value for s in family.samples]
        if family.type != "gauge" or not values or "alert" in name or not any(
                w in name for w in ("analysis", "worker", "queue")):
            continue
        if "lag" in name:
            lag = max(values + ([lag] if lag is not None else []))
        elif any(w in name for w in DEPTH_WORDS):
            depth = sum(values) + (depth or 0)
    return depth, lag


class QueueProbe(Sampler):
    """Queue depth and worker lag as one server's /metrics reports them, every second."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        super().__init__(interval)
        self.client = httpx.Client(base_url=url, timeout=30)
        self.depth: list[tuple[float, float]] = []  # (monotonic time, depth)
        self.lag: list[float] = []

    def read(self) -> tuple[float | None, float | None]:
        """(depth, lag) now; raises httpx.HTTPError when /metrics does not answer 200
        (a server shedding load answers 503: that says nothing about the queue)."""
        reply = self.client.get("/metrics")
        reply.raise_for_status()
        return queue_figures(reply.text)

    def sample(self) -> None:
        try:
            depth, lag = self.read()
        except httpx.HTTPError:
            return
        if depth is not None:
            self.depth.append((time.monotonic(), depth))
        if lag is not None:
            self.lag.append(lag)

    def max_depth(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        values = [d for t, d in self.depth if since <= t <= until]
        return max(values) if values else None

    def stop(self) -> None:
        super().stop()
        self.client.close()


class PageProbe(Sampler):
    """Reads the run page and the ranks API of one run in turn, one request at a time
    with `interval` between, and keeps their latencies: from the first try to a 200, a
    503 retried after its Retry-After as a person reloading would (counted in `shed`);
    a timeout counts as its limit."""

    def __init__(self, url: str, run_id: str, interval: float = 1.0,
                 timeout: float = 30.0) -> None:
        super().__init__(interval)
        self.client = httpx.Client(base_url=url, timeout=timeout)
        self.timeout = timeout
        self.paths = {"run page": f"/runs/{run_id}", "ranks API": f"/api/v1/runs/{run_id}/ranks"}
        self.times: dict[str, list[float]] = {name: [] for name in self.paths}
        self.errors: list[str] = []
        self.shed = 0
        self._turn = 0

    def sample(self) -> None:
        name = list(self.paths)[self._turn % len(self.paths)]
        self._turn += 1
        t0 = time.monotonic()
        while (left := t0 + self.timeout - time.monotonic()) > 0:
            try:
                reply = self.client.get(self.paths[name], timeout=left)
            except httpx.TimeoutException:
                self.errors.append(f"{name}: no answer within {self.timeout:g} s")
                break
            if reply.status_code != 503:
                if reply.status_code != 200:
                    self.errors.append(f"{name}: {reply.status_code}")
                break
            self.shed += 1
            time.sleep(min(left, float(reply.headers.get("retry-after") or 1.0)))
        else:
            self.errors.append(f"{name}: no answer within {self.timeout:g} s")
        self.times[name].append(min(time.monotonic() - t0, self.timeout))

    def summary(self) -> dict:
        every = [t for times in self.times.values() for t in times]
        return {"page_p99_s": percentile(every, 0.99),
                "page_median_s": statistics.median(every) if every else None,
                "page_reads": len(every), "page_shed_503": self.shed,
                "page_errors": self.errors[:5],
                **{f"{name} p99_s": percentile(t, 0.99) for name, t in self.times.items()}}

    def stop(self) -> None:
        super().stop()
        self.client.close()
