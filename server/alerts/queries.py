"""Reading the alert configuration and the outbox for the API (secrets redacted)."""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.alerts.schemas import (
    AlertAttemptPublic,
    AlertRulePublic,
    AlertsPublic,
    AlertTargetPublic,
    DeliveriesPublic,
    DeliveryPublic,
)
from ampwatch.server.alerts.settings import AlertSettings
from ampwatch.server.models import AlertAttempt, AlertNotification, as_utc


def describe_alerts(settings: AlertSettings, public_url: str) -> AlertsPublic:
    return AlertsPublic(
        enabled=settings.enabled, public_url=public_url,
        rules=[AlertRulePublic(**rule.model_dump()) for rule in settings.rules],
        targets=[AlertTargetPublic(name=name, type=target.type, url=target.redacted_url)
                 for name, target in settings.targets.items()],
    )


def list_deliveries(session: Session, *, status: str | None = None,
                    run_id: str | None = None, event: str | None = None, limit: int = 100,
                    offset: int = 0, notification_id: int | None = None) -> DeliveriesPublic:
    """Notifications, newest first, each with its attempts (two queries)."""
    filters = []
    if notification_id is not None:
        filters.append(AlertNotification.id == notification_id)
    if status is not None:
        filters.append(AlertNotification.status == status)
    if run_id is not None:
        filters.append(AlertNotification.run_id == run_id)
    if event is not None:
        filters.append(AlertNotification.event == event)
    total = session.scalar(select(func.count()).select_from(AlertNotification).where(*filters))
    rows = session.scalars(select(AlertNotification).where(*filters)
                           .order_by(AlertNotification.id.desc())
                           .limit(limit).offset(offset)).all()
    history = defaultdict(list)
    if rows:
        for attempt in session.scalars(
                select(AlertAttempt)
                .where(AlertAttempt.notification_id.in_([r.id for r in rows]))
                .order_by(AlertAttempt.id)):
            history[attempt.notification_id].append(AlertAttemptPublic(
                attempt=attempt.attempt, started_at=as_utc(attempt.started_at),
                duration_ms=attempt.duration_ms, ok=attempt.ok,
                status_code=attempt.status_code, error=attempt.error))
    items = [DeliveryPublic(
        id=row.id, event=row.event, rule=row.rule, target=row.target, status=row.status,
        finding_id=row.finding_id, run_id=row.run_id, severity=row.severity,
        title=row.payload.get("title", ""), attempts=row.attempts,
        created_at=as_utc(row.created_at),
        next_attempt_at=as_utc(row.next_attempt_at) if row.status == "pending" else None,
        finished_at=as_utc(row.finished_at), last_error=row.last_error,
        history=history[row.id], payload=row.payload,
    ) for row in rows]
    return DeliveriesPublic(items=items, total=total or 0)
