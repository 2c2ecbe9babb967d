"""GET /metrics: training health and server load in the Prometheus text format.

Per run that is live or stopped reporting (`services/runs.run_state`, as the API says it;
a stopped one until its data is `metrics_stopped_seconds` old), labelled project and run:
where it stands, the loss scale, steps and skipped steps (counters: `rate()` of their
ratio is the recent skip rate), the last step, when it was last seen, the steps it lost,
open findings by severity. Read from the database by a custom collector at scrape time,
so a finished run drops out by itself and every replica reports the same runs (no
per-run gauges to forget); so are the analysis queue's depth and lag
(server/worker/queue.py). Server counters and latency histograms are per process, in a
registry of the app's own (no global state).
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Iterator
from datetime import timedelta

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.deps import SettingsDep
from ampwatch.server.findings.queries import open_severities_by_run
from ampwatch.server.models import AlertNotification, utcnow
from ampwatch.server.schemas.batches import BatchAck
from ampwatch.server.services.runs import rank_totals, run_state, runs_seen_since
from ampwatch.server.settings import Settings
from ampwatch.server.worker.queue import lag_seconds, pending_batches

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
class ServerMetrics:
    """This process's metrics: ingest counters and latencies, page latencies, and the
    run-health collector that reads the database at scrape time."""

    def __init__(self, maker: sessionmaker, settings: Settings) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ingest_requests = Counter("ampwatch_ingest_requests",
                                       "Batch POST requests by HTTP status", ["code"],
                                       registry=r)
        self.ingest_batches = Counter("ampwatch_ingest_batches",
                                      "Batches stored (duplicates not counted)", registry=r)
        self.ingest_duplicates = Counter("ampwatch_ingest_duplicate_batches",
                                         "Batches acknowledged as replays", registry=r)
        self.ingest_steps = Counter("ampwatch_ingest_steps", "Steps stored", registry=r)
        self.ingest_bytes = Counter("ampwatch_ingest_bytes",
                                    "Batch request bytes as received (gzip bodies compressed)",
                                    registry=r)
        self.ingest_seconds = Histogram("ampwatch_ingest_duration_seconds",
                                        "Batch POST latency (analysis is not part of it)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.analysis_seconds = Histogram(
            "ampwatch_analysis_duration_seconds",
            "Detector time per stored batch, in this server's worker thread: it judges a "
            "fixed window, so it should not grow with the run's length",
            buckets=LATENCY_BUCKETS, registry=r)
        self.page_seconds = Histogram("ampwatch_page_duration_seconds",
                                      "Dashboard page latency by page", ["page"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        ProcessCollector(registry=r)
        r.register(RunHealthCollector(maker, settings.live_seconds,
                                      settings.metrics_stopped_seconds))

    def batch_acknowledged(self, ack: BatchAck) -> None:
        if ack.duplicate:
            self.ingest_duplicates.inc()
        else:
            self.ingest_batches.inc()
            self.ingest_steps.inc(ack.stored_steps)

    def scrape(self) -> bytes:
        """The text exposition; costs six grouped queries (live and recently stopped runs
        only, and the analysis queue)."""
        return generate_latest(self.registry)


class RunHealthCollector:
    """Per run gauges and counters, read from `runs`, `run_ranks` and `findings` when
    Prometheus scrapes. Bounded: only runs with data in the last `live_seconds` (or
    `stopped_seconds`, when longer) whose agents have not all detached."""

    REPORTING = ("live", "stopped")  # the states of a run on /metrics

    def __init__(self, maker: sessionmaker, live_seconds: float,
                 stopped_seconds: float) -> None:
        self.maker = maker
        self.live_seconds = live_seconds
        self.window = timedelta(seconds=max(live_seconds, stopped_seconds))

    def describe(self) -> list[Metric]:
        return []  # families depend on the database; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        now = utcnow()
        labels = ["project", "run"]
        families = {
            "reporting": GaugeMetricFamily(
                "ampwatch_run_reporting", "1 for where the run stands: live (data within "
                "live_seconds) or stopped (quiet since, not finished), as the API's "
                "`reporting`", labels=[*labels, "state"]),
            "scale": GaugeMetricFamily("ampwatch_run_loss_scale",
                                       "GradScaler loss scale (lowest over ranks)", labels=labels),
            "steps": CounterMetricFamily("ampwatch_run_steps",
                                         "Optimizer steps received (all ranks)", labels=labels),
            "skipped": CounterMetricFamily("ampwatch_run_skipped_steps",
                                           "Steps the scaler skipped (all ranks)", labels=labels),
            "ratio": GaugeMetricFamily("ampwatch_run_skip_ratio",
                                       "Skipped share of all steps so far; for the recent "
                                       "rate use rate() of the two counters", labels=labels),
            "last": GaugeMetricFamily("ampwatch_run_last_step", "Latest step of any rank",
                                      labels=labels),
            "seen": GaugeMetricFamily("ampwatch_run_last_seen_timestamp_seconds",
                                      "When the run's newest data was made (Unix time), as "
                                      "the API's `last_seen_at`", labels=labels),
            "age": GaugeMetricFamily("ampwatch_run_seconds_since_data",
                                     "Seconds since the run's newest data", labels=labels),
            "lost": GaugeMetricFamily("ampwatch_run_steps_lost",
                                      "Steps that never arrived, as the API's `steps_lost`",
                                      labels=labels),
            "open": GaugeMetricFamily("ampwatch_run_open_findings",
                                      "Open findings by severity",
                                      labels=[*labels, "severity"]),
        }
        with self.maker() as session:
            seen = runs_seen_since(session, now - self.window)
            totals = rank_totals(session, [run.id for run in seen])
            states = {run.id: run_state(totals.get(run.id), self.live_seconds, now)
                      for run in seen}
            # a run whose every rank detached (the agent's "finished" event) is over
            runs = [run for run in seen if states[run.id].reporting in self.REPORTING]
            # open as everywhere: incidents marked handled left out
            open_counts = collections.Counter(
                (run_id, severity) for run_id, found
                in open_severities_by_run(session, [run.id for run in runs]).items()
                for severity in found)
            pending = session.scalar(select(func.count()).select_from(AlertNotification)
                                     .where(AlertNotification.status == "pending"))
            backlog, lag = pending_batches(session), lag_seconds(session)
        for run in runs:
            values = [run.project, run.id]
            total, state = totals[run.id], states[run.id]
            for reporting in self.REPORTING:
                families["reporting"].add_metric([*values, reporting],
                                                 float(state.reporting == reporting))
            if total.lowest_scale is not None:
                families["scale"].add_metric(values, total.lowest_scale)
            steps, skipped = int(total.steps or 0), int(total.skipped or 0)
            families["steps"].add_metric(values, steps)
            families["skipped"].add_metric(values, skipped)
            families["ratio"].add_metric(values, skipped / steps if steps else 0.0)
            if total.last_step is not None:
                families["last"].add_metric(values, total.last_step)
            families["seen"].add_metric(values, state.last_seen_at.timestamp())
            families["age"].add_metric(
                values, max((now - state.last_seen_at).total_seconds(), 0.0))
            families["lost"].add_metric(values, state.steps_lost)
            for severity in SEVERITY_RANK:
                families["open"].add_metric([*values, severity],
                                            open_counts.get((run.id, severity), 0))
        yield from families.values()
        count = collections.Counter(states[run.id].reporting for run in runs)
        yield GaugeMetricFamily("ampwatch_live_runs", "Runs training now: data within "
                                "live_seconds and not every rank finished",
                                value=count["live"])
        yield GaugeMetricFamily("ampwatch_stopped_runs", "Runs that stopped reporting: "
                                "quiet past live_seconds without finishing (within "
                                "metrics_stopped_seconds)", value=count["stopped"])
        yield GaugeMetricFamily("ampwatch_alert_notifications_pending",
                                "Alert notifications in the outbox not yet delivered",
                                value=pending or 0)
        yield GaugeMetricFamily("ampwatch_analysis_backlog_batches",
                                "Stored batches waiting for the detectors (the analysis "
                                "queue, all servers and workers)", value=backlog)
        yield GaugeMetricFamily("ampwatch_analysis_lag_seconds",
                                "Seconds the oldest waiting batch has waited for the "
                                "detectors (0: none waits)", value=lag)


def require_scrape_token(request: Request, settings: SettingsDep) -> None:
    """401 unless no token is set, or the request carries `metrics_token` (when set) or
    the API `token` as a bearer token. Prometheus: `authorization: {credentials: ...}`."""
    accepted = [t.get_secret_value().encode() for t in (settings.metrics_token, settings.token)
                if t is not None]
    if not accepted:
        return
    scheme, _, supplied = request.headers.get("authorization", "").partition(" ")
    given = supplied.strip().encode() if scheme.lower() == "bearer" else b""
    if not any(hmac.compare_digest(given, token) for token in accepted):
        raise HTTPException(status_code=401, detail="missing or wrong scrape token: send "
                            "'Authorization: Bearer <AMPWATCH_METRICS_TOKEN or AMPWATCH_TOKEN>'",
                            headers={"WWW-Authenticate": "Bearer"})


router = APIRouter(include_in_schema=False)


@router.get("/metrics", dependencies=[Depends(require_scrape_token)])
def scrape(request: Request) -> Response:
    return Response(request.app.state.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

