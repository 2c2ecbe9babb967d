"""/api/v1/runs/{run_id}/spikes: a run's loss spikes with their likely causes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import RunIdPath, SessionDep
from ampwatch.server.findings.queries import list_findings
from ampwatch.server.findings.schemas import FindingPublic, SpikePublic, SpikesPublic
from ampwatch.server.services.runs import get_run

router = APIRouter(prefix="/runs", tags=["findings"])
MAX_SPIKES = 1000


def spike_of(finding: FindingPublic) -> SpikePublic:
    evidence = finding.evidence
    return SpikePublic(
        finding=finding.id, rank=finding.rank, step=finding.step or 0,
        end_step=evidence.get("end_step"), peak=evidence.get("peak"),
        median=evidence.get("median"), ratio=evidence.get("ratio"),
        label=finding.code or "unknown", layer=finding.layer,
        precursor_step=evidence.get("precursor_step"), lead_steps=evidence.get("lead_steps"),
        recovered_at=evidence.get("recovered_at"), fix=evidence.get("fix"),
        incident=finding.incident)


def list_spikes(session: Session, run_id: str, rank: int | None = None) -> SpikesPublic:
    """The run's spikes (open and resolved, of one rank when given) in step order."""
    get_run(session, run_id)
    found = list_findings(session, run_id=run_id, kind=FindingKind.LOSS_SPIKE, rank=rank,
                          limit=MAX_SPIKES).items
    return SpikesPublic(items=sorted((spike_of(f) for f in found),
                                     key=lambda spike: (spike.step, spike.rank)))


@router.get("/{run_id}/spikes", operation_id="list_spikes",
            response_model=SpikesPublic, responses=READ | NOT_FOUND,
            dependencies=[AnalysisWait])
def get_spikes(run_id: RunIdPath, session: SessionDep,
               rank: Annotated[int | None, Query(ge=0, le=1_000_000)] = None) -> SpikesPublic:
    """The run's loss spikes in step order (at most 1,000), each with its likely cause,
    layer, precursor step, lead time, recovery and fix (docs/spikes.md)."""
    return list_spikes(session, run_id, rank)
