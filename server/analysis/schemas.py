"""API schemas of findings (apart from the ORM model `models.Finding`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from ampwatch.server.schemas import Severity

FindingStatus = Literal["open", "resolved"]
FindingKind = Literal[
    "scaler_divergence",
    "nonfinite",
    "overflow_risk",
    "underflow_risk",
    "misaligned_layer",
    "precision_map",
    "pitfall",
    "speed",
]


class FindingPublic(BaseModel):
    """Something the analysis flagged; `message` says what to do about it."""

    id: int
    run_id: str
    kind: str
    code: str | None
    severity: Severity
    status: FindingStatus
    rank: int
    step: int | None
    last_step: int | None
    layer: str | None
    message: str
    evidence: dict[str, Any]
    count: int
    created_at: datetime
    updated_at: datetime


class FindingsPublic(BaseModel):
    items: list[FindingPublic]
    total: int
    limit: int
    offset: int
