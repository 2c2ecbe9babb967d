"""/api/v1/runs/{run_id}/fp8: a run's FP8 layers and what their casts lose."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from ampwatch.server.analysis.kinds import Section, kinds_in
from ampwatch.server.analysis.queries import list_findings
from ampwatch.server.analysis.schemas import Fp8Public
from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.api.runs import RunIdPath
from ampwatch.server.api.series import End, Rank, Start
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import SessionDep
from ampwatch.server.runs import get_run
from ampwatch.server.store.fp8_samples import fp8_report
from ampwatch.server.store.storage import load_layers

router = APIRouter(prefix="/runs", tags=["series"])
MAX_FINDINGS = 500


def fp8_twin(session: Session, run_id: str, *, rank: int, start: int | None,
             end: int | None, buckets: int) -> dict:
    """The FP8 report of a run and rank, with the run's FP8 findings."""
    get_run(session, run_id)
    report = fp8_report(session, run_id, load_layers(session, run_id), rank, start=start,
                        end=end, buckets=buckets)
    findings = [f.model_dump(mode="json") for kind in kinds_in(Section.FP8)
                for f in list_findings(session, run_id=run_id, kind=kind,
                                       limit=MAX_FINDINGS).items]
    return {"rank": rank, **report, "findings": findings}


@router.get("/{run_id}/fp8", operation_id="get_fp8_report",
            response_model=Fp8Public, responses=READ | NOT_FOUND,
            dependencies=[AnalysisWait])
def get_fp8(
    run_id: RunIdPath,
    session: SessionDep,
    rank: Rank = 0,
    start: Start = None,
    end: End = None,
    buckets: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict:
    """FP8 layers (recipe, formats, latest amax/scale/rms/shares per tensor) and, per
    (layer, tensor), the shares of elements saturated and flushed to zero over step
    buckets; the run's fp8 findings."""
    return fp8_twin(session, run_id, rank=rank, start=start, end=end, buckets=buckets)
