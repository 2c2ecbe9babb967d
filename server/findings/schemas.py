"""API schemas of findings (apart from the ORM model `models.Finding`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.schemas.common import Severity, WireNumber

FindingStatus = Literal["open", "resolved"]
# handled: open, but marked handled and quiet since (server/findings/handled.py)
IncidentStatus = Literal["open", "handled", "resolved"]


class FindingPublic(BaseModel):
    """Something the analysis flagged; `message` says what to do about it."""

    id: int
    run_id: str
    kind: FindingKind
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
    incident: int | None = None  # id of the incident (root cause) it belongs to


class FindingsPublic(BaseModel):
    items: list[FindingPublic]
    total: int
    limit: int
    offset: int


class TimelineEntryPublic(BaseModel):
    step: int | None
    what: str
    finding: int
    severity: Severity


class IncidentPublic(BaseModel):
    """Findings that share one root cause (the same rank, cause and layer), told once:
    `headline` and `fix` say what went wrong and what to do (None for an incident of one
    finding without a known cause: its finding's message says it), `timeline` how it
    played out. `problem`: open (not handled) and at least a warning. `status`
    "handled": open, but a person marked it handled and its signal has not returned
    since; it counts as open nowhere."""

    id: int
    run_id: str
    rank: int
    cause: str | None
    layer: str | None
    severity: Severity
    status: IncidentStatus
    problem: bool
    step: int | None
    last_step: int | None
    headline: str | None
    fix: str | None
    findings: list[int]
    timeline: list[TimelineEntryPublic]


class IncidentsPublic(BaseModel):
    items: list[IncidentPublic]
    total: int


class Fp8LayerPublic(BaseModel):
    """An FP8 layer: its scaling recipe, the format of each tensor it casts, and the
    statistics of its latest sample per tensor (amax, scale, rms, saturated, underflow)."""

    index: int
    name: str
    recipe: str
    formats: dict[str, str | None]
    latest: dict[str, dict[str, float | int | str]]


class Fp8Public(BaseModel):
    """/api/v1/runs/{id}/fp8: rows are (layer, tensor) pairs; `underflow` and `saturated`
    are rows x step buckets of the largest share seen (null: no sample in the bucket)."""

    rank: int
    layers: list[Fp8LayerPublic]
    rows: list[str]
    steps: list[int]
    underflow: list[list[WireNumber | None]]
    saturated: list[list[WireNumber | None]]
    samples: int
    findings: list[FindingPublic]


class SpikePublic(BaseModel):
    """A loss spike (a `loss_spike` finding, read as a spike; docs/spikes.md): its first
    and last step, peak, the median it rose from and the ratio, its likely cause
    (`label`) with the layer, the precursor's first step and the lead time it gave, the
    step the loss came back (null: not yet) and the fix."""

    finding: int
    rank: int
    step: int
    end_step: int | None
    peak: WireNumber | None
    median: WireNumber | None
    ratio: WireNumber | None
    label: str
    layer: str | None
    precursor_step: int | None
    lead_steps: int | None
    recovered_at: int | None
    fix: str | None
    incident: int | None


class SpikesPublic(BaseModel):
    items: list[SpikePublic]
