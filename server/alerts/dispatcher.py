"""Sending the outbox: one daemon thread per server process claims due notifications,
sends them, records every attempt, and retries failures with exponential backoff.

Claims are safe across processes and replicas sharing one database: a row is taken by a
conditional UPDATE (due, unclaimed or its lease expired) that sets a fresh claim token,
so of two dispatchers racing for a row one wins and the other moves on (on Postgres the
candidate is picked with SKIP LOCKED). The lease outlives a send's timeout; a server that
dies mid-send leaves a claim that another dispatcher takes over once it expires. The only
repeat possible is a receiver that accepted a notification while its sender died before
recording it; the `Idempotency-Key` header (and `notification_id`) lets receivers drop it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from datetime import datetime, timedelta

import httpx
from sqlalchemy import or_, select, update
from sqlalchemy.orm import sessionmaker

from ampwatch.server.alerts.senders import SendResult, send
from ampwatch.server.alerts.settings import AlertSettings
from ampwatch.server.db import writing
from ampwatch.server.models import AlertAttempt, AlertNotification, utcnow

log = logging.getLogger("ampwatch.alerts")

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
LEASE_MARGIN_S = 30.0
JITTER = 0.1  # +-10% on each backoff, so replicas' retries do not line up


def backoff_s(attempts: int, settings: AlertSettings) -> float:
    """Seconds before the next try after `attempts` failed ones (before jitter)."""
    return min(settings.backoff_initial_s * 2.0 ** (attempts - 1), settings.backoff_max_s)


class Dispatcher:
    """The outbox sender of one server process. `start()` runs it on a daemon thread;
    `wake()` makes it look for work now (called after a commit that queued some);
    `stop()` lets the send in flight finish, waiting up to `timeout`."""

    def __init__(self, maker: sessionmaker, settings: AlertSettings) -> None:
        self.maker = maker
        self.settings = settings
        self.lease = timedelta(seconds=settings.timeout_s + LEASE_MARGIN_S)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: httpx.Client | None = None
        self._dialect = maker.kw["bind"].dialect.name

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._http = httpx.Client(timeout=self.settings.timeout_s, follow_redirects=False)
        self._thread = threading.Thread(target=self._loop, name="ampwatch-alerts",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None
        if self._http is not None:
            self._http.close()
            self._http = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                while not self._stop.is_set() and self.send_one():
                    pass
            except Exception:  # the database may be away for a while: keep trying
                log.exception("alert dispatcher: could not read the outbox; retrying")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def send_one(self, now: datetime | None = None) -> bool:
        """Claim one due notification and try to send it; False when none is due.
        Blocks for the send (up to the target's timeout)."""
        claimed = self._claim(now or utcnow())
        if claimed is None:
            return False
        notification, token = claimed
        target = self.settings.targets.get(notification.target)
        started = utcnow()
        t0 = time.perf_counter()
        if target is None:
            result = SendResult(False, error=f"target {notification.target!r} is no "
                                             "longer configured")
        else:
            payload = {**notification.payload, "notification_id": notification.id}
            result = send(target, payload, self._http_client())
        self._record(notification, token, result, started,
                     (time.perf_counter() - t0) * 1000.0, gone=target is None)
        return True

    def _http_client(self) -> httpx.Client:
        if self._http is None:  # send_one called without start() (tests, the CLI)
            self._http = httpx.Client(timeout=self.settings.timeout_s)
        return self._http

    def _claim(self, now: datetime) -> tuple[AlertNotification, str] | None:
        token = uuid.uuid4().hex
        claimable = (AlertNotification.status == PENDING,
                     AlertNotification.next_attempt_at <= now,
                     or_(AlertNotification.claimed_until.is_(None),
                         AlertNotification.claimed_until < now))
        candidate = (select(AlertNotification.id).where(*claimable)
                     .order_by(AlertNotification.next_attempt_at, AlertNotification.id)
                     .limit(1))
        if self._dialect == "postgresql":
            candidate = candidate.with_for_update(skip_locked=True)
        with self.maker() as session, writing(session):
            taken = session.execute(
                update(AlertNotification)
                .where(AlertNotification.id == candidate.scalar_subquery(), *claimable)
                .values(claim=token, claimed_until=now + self.lease)
            ).rowcount
            session.commit()
            if not taken:
                return None
            notification = session.scalars(
                select(AlertNotification).where(AlertNotification.claim == token)).one()
        return notification, token

    def _record(self, notification: AlertNotification, token: str, result: SendResult,
                started: datetime, duration_ms: float, *, gone: bool) -> None:
        attempt = notification.attempts + 1
        now = utcnow()
        values: dict = {"attempts": attempt, "claim": None, "claimed_until": None,
                        "last_error": result.error}
        if result.ok:
            values |= {"status": DELIVERED, "finished_at": now}
        elif gone or attempt >= self.settings.max_attempts:
            values |= {"status": FAILED, "finished_at": now}
        else:
            delay = backoff_s(attempt, self.settings) * random.uniform(1 - JITTER, 1 + JITTER)
            values["next_attempt_at"] = now + timedelta(seconds=delay)
        with self.maker() as session, writing(session):
            session.add(AlertAttempt(notification_id=notification.id, attempt=attempt,
                                     started_at=started, duration_ms=duration_ms,
                                     ok=result.ok, status_code=result.status_code,
                                     error=result.error))
            kept = session.execute(
                update(AlertNotification)
                .where(AlertNotification.id == notification.id,
                       AlertNotification.claim == token)
                .values(**values)
            ).rowcount
            session.commit()
        what = (f"notification {notification.id} ({notification.event}, rule "
                f"{notification.rule!r}) to target {notification.target!r}")
        if not kept:
            log.warning("alert %s: its claim expired during the send; another dispatcher "
                        "may send it again", what)
        elif result.ok:
            log.info("alert %s delivered on attempt %d", what, attempt)
        elif values.get("status") == FAILED:
            log.error("alert %s failed for good after %d attempts: %s", what, attempt,
                      result.error)
        else:
            log.warning("alert %s failed (attempt %d, next in %.0f s): %s", what, attempt,
                        (values["next_attempt_at"] - now).total_seconds(), result.error)
