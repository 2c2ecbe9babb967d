"""Findings of the analysis: per run, and across runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.analysis.kinds import kind_help
from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import RunIdPath, SessionDep
from ampwatch.server.fields import NO_NUL
from ampwatch.server.findings.queries import list_findings, list_incidents
from ampwatch.server.findings.schemas import (
    FindingKind,
    FindingsPublic,
    FindingStatus,
    IncidentsPublic,
    IncidentStatus,
)
from ampwatch.server.schemas.common import MAX_PAGE_LIMIT, PAGE_LIMIT, Severity
from ampwatch.server.services.runs import get_run
from ampwatch.wire import RUN_ID_PATTERN

router = APIRouter(tags=["findings"])
Code = Annotated[str | None, Query(max_length=64, pattern=NO_NUL, description="pitfall code, e.g. "
                                   "clip_before_unscale")]
Kind = Annotated[FindingKind | None, Query(description="only findings of this kind:\n"
                                             + kind_help())]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)]
Offset = Annotated[int, Query(ge=0, le=10**9)]


@router.get("/runs/{run_id}/findings", operation_id="list_findings", response_model=FindingsPublic,
            responses=READ | NOT_FOUND, dependencies=[AnalysisWait])
def get_run_findings(
    run_id: RunIdPath,
    session: SessionDep,
    kind: Kind = None,
    code: Code = None,
    severity: Severity | None = None,
    status: FindingStatus | None = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000)] = None,
    limit: Limit = PAGE_LIMIT,
    offset: Offset = 0,
) -> FindingsPublic:
    """A run's findings: open first, most severe first; 404 for an unknown run."""
    get_run(session, run_id)
    return list_findings(session, run_id=run_id, kind=kind, code=code, severity=severity,
                         status=status, rank=rank, limit=limit, offset=offset)


@router.get("/runs/{run_id}/incidents", operation_id="list_incidents",
            response_model=IncidentsPublic,
            responses=READ | NOT_FOUND, dependencies=[AnalysisWait])
def get_run_incidents(
    run_id: RunIdPath,
    session: SessionDep,
    status: IncidentStatus | None = None,
    severity: Severity | None = None,
) -> IncidentsPublic:
    """A run's findings grouped by root cause (same rank, cause and layer): one incident
    with a headline, the first step, the fix and a timeline; open first, then handled
    (marked handled, quiet since: open nowhere), most severe first. Each finding's
    `incident` field names its incident. 404 for an unknown run."""
    get_run(session, run_id)
    return list_incidents(session, run_id, status=status, severity=severity)


@router.get("/findings", operation_id="list_all_findings",
            response_model=FindingsPublic, responses=READ,
            dependencies=[AnalysisWait])
def get_findings(
    session: SessionDep,
    run_id: Annotated[str | None, Query(pattern=RUN_ID_PATTERN)] = None,
    kind: Kind = None,
    code: Code = None,
    severity: Severity | None = None,
    status: FindingStatus | None = None,
    limit: Limit = PAGE_LIMIT,
    offset: Offset = 0,
) -> FindingsPublic:
    """Findings across runs, most recently updated first."""
    return list_findings(session, run_id=run_id, kind=kind, code=code, severity=severity,
                         status=status, limit=limit, offset=offset)
