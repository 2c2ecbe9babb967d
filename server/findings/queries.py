"""Reading findings for the API: filters, ordering and pagination."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import case, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ampwatch.server.findings.bisect_verdicts import with_verdicts
from ampwatch.server.findings.handled import apply_marks, handled_marks, open_severities
from ampwatch.server.findings.incidents import (
    Incident,
    group_incidents,
    incident_of,
    needs_layer_order,
)
from ampwatch.server.findings.schemas import (
    FindingPublic,
    FindingsPublic,
    IncidentPublic,
    IncidentsPublic,
)
from ampwatch.server.models import Bundle, Finding, Layer, as_utc

SEVERITY_ORDER = case({"critical": 0, "warning": 1, "info": 2}, value=Finding.severity, else_=3)
OPEN_FIRST = case((Finding.status == "open", 0), else_=1)


def finding_public(finding: Finding, incident: int | None = None) -> FindingPublic:
    return FindingPublic(
        id=finding.id, run_id=finding.run_id, kind=finding.kind, code=finding.code,
        severity=finding.severity, status=finding.status, rank=finding.rank,
        step=finding.step, last_step=finding.last_step, layer=finding.layer,
        message=finding.message, evidence=finding.evidence or {}, count=finding.count,
        created_at=as_utc(finding.created_at), updated_at=as_utc(finding.updated_at),
        incident=incident,
    )


def list_findings(
    session: Session,
    *,
    run_id: str | None = None,
    kind: str | None = None,
    code: str | None = None,
    severity: str | None = None,
    status: str | None = None,
    rank: int | None = None,
    limit: int = 100,
    offset: int = 0,
) -> FindingsPublic:
    """Findings matching every filter given. Within a run: open first, then most severe,
    then by first step; across runs: most recently updated first."""
    query = select(Finding)
    for column, value in ((Finding.run_id, run_id), (Finding.kind, kind),
                          (Finding.code, code), (Finding.severity, severity),
                          (Finding.status, status), (Finding.rank, rank)):
        if value is not None:
            query = query.where(column == value)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    if run_id is not None:
        order = (OPEN_FIRST, SEVERITY_ORDER, Finding.step, Finding.id)
    else:
        order = (Finding.updated_at.desc(), Finding.id.desc())
    rows = list(session.scalars(query.order_by(*order).limit(limit).offset(offset)))
    incident = {}
    for incidents in incidents_by_run(session, {f.run_id for f in rows}).values():
        incident |= incident_of(incidents)
    return FindingsPublic(items=[finding_public(f, incident.get(f.id)) for f in rows],
                          total=total, limit=limit, offset=offset)


def incidents_by_run(session: Session, run_ids: Iterable[str], *,
                     open_only: bool = False) -> dict[str, list[Incident]]:
    """The incidents of each run, from all its findings: open, then handled (marked
    handled and quiet since: server/findings/handled.py), then resolved; `open_only`
    leaves the resolved ones out. One query of findings (per run they are few: one per
    key and episode), one of the handled marks."""
    run_ids = list(run_ids)
    if not run_ids:
        return {}
    query = select(Finding).where(Finding.run_id.in_(run_ids)).order_by(Finding.id)
    by_run: dict[str, list[Finding]] = {run_id: [] for run_id in run_ids}
    for finding in session.scalars(query):
        by_run[finding.run_id].append(finding)
    orders = layer_orders(session, [run_id for run_id, found in by_run.items()
                                    if needs_layer_order(found)])
    verdicts = bisected_bundles(session, run_ids)
    marks = handled_marks(session, run_ids)
    found_by_run = {}
    for run_id, found in by_run.items():
        incidents = with_verdicts(group_incidents(found, orders.get(run_id)),
                                  verdicts.get(run_id, ()))
        if run_id in marks:
            incidents = apply_marks(incidents, marks[run_id],
                                    {f.id: as_utc(f.updated_at) for f in found})
        found_by_run[run_id] = [i for i in incidents
                                if not open_only or i.status != "resolved"]
    return found_by_run


def open_severities_by_run(session: Session, run_ids: Iterable[str]) -> dict[str, list[str]]:
    """Per run, the severities of its open findings, less those of incidents marked
    handled (server/findings/handled.py): what the run's status, its counts and
    /metrics count. One query; the incidents are grouped only for runs with a mark."""
    run_ids = list(run_ids)
    severity_of: dict[str, dict[int, str]] = {run_id: {} for run_id in run_ids}
    if run_ids:
        for run_id, finding_id, severity in session.execute(
                select(Finding.run_id, Finding.id, Finding.severity)
                .where(Finding.run_id.in_(run_ids), Finding.status == "open")):
            severity_of[run_id][finding_id] = severity
    marked = [run_id for run_id in handled_marks(session, run_ids) if severity_of[run_id]]
    incidents = incidents_by_run(session, marked, open_only=True)
    return {run_id: (open_severities(incidents[run_id], found) if run_id in incidents
                     else list(found.values()))
            for run_id, found in severity_of.items()}


def bisected_bundles(session: Session | Connection,
                     run_ids: Iterable[str]) -> dict[str, list[dict]]:
    """Per run, its bundles that `ampwatch replay --bisect` judged: rank, step and the
    verdict (`bisect`), what `with_verdicts` tells the incidents' fixes by. One query;
    a run holds a few bundles (`max_bundles` per rank)."""
    found: dict[str, list[dict]] = {}
    for run_id, rank, step, verdict in session.execute(
            select(Bundle.run_id, Bundle.rank, Bundle.step, Bundle.bisect)
            .where(Bundle.run_id.in_(list(run_ids)), Bundle.bisect.is_not(None))):
        found.setdefault(run_id, []).append({"rank": rank, "step": step, "bisect": verdict})
    return found


def layer_orders(session: Session | Connection,
                 run_ids: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per run, layer name -> position in forward execution order (the layer table's
    order for layers the agent did not see run): what `group_incidents` needs to tell a
    layer downstream of another. One query, only for the runs given."""
    run_ids = list(run_ids)
    if not run_ids:
        return {}
    orders: dict[str, dict[str, int]] = {}
    for run_id, name, index, forward in session.execute(
            select(Layer.run_id, Layer.name, Layer.index, Layer.forward_index)
            .where(Layer.run_id.in_(run_ids))):
        orders.setdefault(run_id, {})[name] = index if forward is None else forward
    return orders


def incident_public(incident: Incident) -> IncidentPublic:
    return IncidentPublic(**{**vars(incident), "problem": incident.problem,
                             "timeline": [vars(t) for t in incident.timeline]})


def list_incidents(session: Session, run_id: str, *, status: str | None = None,
                   severity: str | None = None) -> IncidentsPublic:
    """A run's incidents, open first, most severe first, then by first step."""
    incidents = [i for i in incidents_by_run(session, [run_id])[run_id]
                 if (status is None or i.status == status)
                 and (severity is None or i.severity == severity)]
    return IncidentsPublic(items=[incident_public(i) for i in incidents], total=len(incidents))
