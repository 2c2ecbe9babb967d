"""API schemas of /api/v1/alerts: rules, targets (URLs redacted) and deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.schemas.common import Severity

NotificationStatus = Literal["pending", "delivered", "failed"]


class AlertTargetPublic(BaseModel):
    name: str
    type: Literal["webhook", "apprise"]
    url: str  # redacted: scheme and host of a web URL, only the scheme of any other


class AlertRulePublic(BaseModel):
    name: str
    severity: Severity
    projects: list[str]
    kinds: list[FindingKind]
    on_resolve: bool
    targets: list[str]
    per: Literal["incident", "finding"]


class AlertsPublic(BaseModel):
    enabled: bool
    public_url: str
    rules: list[AlertRulePublic]
    targets: list[AlertTargetPublic]


class AlertAttemptPublic(BaseModel):
    attempt: int
    started_at: datetime
    duration_ms: float
    ok: bool
    status_code: int | None = None
    error: str | None = None


class DeliveryPublic(BaseModel):
    """One notification to one target, with every attempt at sending it."""

    id: int
    event: Literal["opened", "escalated", "resolved", "reopened", "test"]
    rule: str
    target: str
    status: NotificationStatus
    finding_id: int | None = None
    run_id: str | None = None
    severity: str | None = None
    title: str
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None = None
    finished_at: datetime | None = None
    last_error: str | None = None
    history: list[AlertAttemptPublic]
    payload: dict[str, Any]


class DeliveriesPublic(BaseModel):
    items: list[DeliveryPublic]
    total: int


class TestNotificationsPublic(BaseModel):
    """The test notifications queued, one per target; follow them in deliveries."""

    ids: list[int]
    targets: list[str]
