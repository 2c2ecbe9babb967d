"""/api/v1/alerts: the alert rules and targets, the deliveries, and test notifications."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from ampwatch.server.alerts.queries import describe_alerts, list_deliveries
from ampwatch.server.alerts.schemas import (
    AlertsPublic,
    DeliveriesPublic,
    DeliveryPublic,
    NotificationStatus,
    TestNotificationsPublic,
)
from ampwatch.server.api.error_responses import CONFLICT, NOT_FOUND, READ, WRITE, errors
from ampwatch.server.db import writing
from ampwatch.server.deps import SessionDep
from ampwatch.server.errors import Conflict, NotFound
from ampwatch.server.fields import INT32_MAX
from ampwatch.wire import RUN_ID_PATTERN

router = APIRouter(prefix="/alerts", tags=["alerts"])
TargetName = Annotated[str | None, Query(max_length=64, description="one target's name "
                                         "(default: every target)")]


@router.get("", operation_id="get_alerts", response_model=AlertsPublic, responses=errors(503))
def get_alerts(request: Request) -> AlertsPublic:
    """The alert rules and targets; target URLs are redacted (no tokens or passwords)."""
    service = request.app.state.alerts
    return describe_alerts(service.settings, service.outbox.public_url)


@router.get("/deliveries", operation_id="list_deliveries",
            response_model=DeliveriesPublic, responses=READ)
def get_deliveries(
    session: SessionDep,
    status: NotificationStatus | None = None,
    run_id: Annotated[str | None, Query(pattern=RUN_ID_PATTERN)] = None,
    event: Annotated[str | None,
                     Query(pattern=r"^(opened|escalated|resolved|reopened|test)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> DeliveriesPublic:
    """Notifications, newest first, with every attempt at sending each (pending ones
    show when they are tried next; failed ones gave up after the last attempt)."""
    return list_deliveries(session, status=status, run_id=run_id, event=event, limit=limit,
                           offset=offset)


@router.get("/deliveries/{notification_id}", operation_id="get_delivery",
            response_model=DeliveryPublic,
            responses=READ | NOT_FOUND)
def get_delivery(session: SessionDep,
                 notification_id: Annotated[int, Path(ge=1, le=INT32_MAX)]) -> DeliveryPublic:
    """One notification with its attempts; 404 when there is none."""
    found = list_deliveries(session, notification_id=notification_id, limit=1).items
    if not found:
        raise NotFound(f"no alert notification with id {notification_id}")
    return found[0]


@router.post("/test", operation_id="send_test_alert", response_model=TestNotificationsPublic,
             responses=WRITE | NOT_FOUND | CONFLICT)
def post_test(request: Request, session: SessionDep,
              target: TargetName = None) -> TestNotificationsPublic:
    """Queue a test notification to every target (or to `target`); the dispatcher sends
    it as any other. 409 when no target is configured, 404 for an unknown one."""
    service = request.app.state.alerts
    names = list(service.settings.targets)
    if not names:
        # a valid request the configuration cannot serve: a conflict, not invalid input
        raise Conflict("no alert targets are configured (see docs/alerts.md)")
    if target is not None:
        if target not in names:
            raise NotFound(f"no alert target named {target!r}; targets: {', '.join(names)}")
        names = [target]
    with writing(session):
        ids = service.outbox.enqueue_test(session, names)
        session.commit()
    return TestNotificationsPublic(ids=ids, targets=names)
