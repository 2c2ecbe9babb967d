"""Reading findings for the API: filters, ordering and pagination."""

from __future__ import annotations

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.schemas import FindingPublic, FindingsPublic
from ampwatch.server.models import Finding
from ampwatch.server.runs import as_utc

SEVERITY_ORDER = case({"critical": 0, "warning": 1, "info": 2}, value=Finding.severity, else_=3)
OPEN_FIRST = case((Finding.status == "open", 0), else_=1)


def finding_public(finding: Finding) -> FindingPublic:
    return FindingPublic(
        id=finding.id, run_id=finding.run_id, kind=finding.kind, code=finding.code,
        severity=finding.severity, status=finding.status, rank=finding.rank,
        step=finding.step, last_step=finding.last_step, layer=finding.layer,
        message=finding.message, evidence=finding.evidence or {}, count=finding.count,
        created_at=as_utc(finding.created_at), updated_at=as_utc(finding.updated_at),
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
    rows = session.scalars(query.order_by(*order).limit(limit).offset(offset))
    return FindingsPublic(items=[finding_public(f) for f in rows], total=total,
                          limit=limit, offset=offset)
