"""/api/v1/runs/{run_id}/fp8: a run's FP8 layers and what their casts lose."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.api.series import End, Rank, Start
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import RunIdPath, SessionDep
from ampwatch.server.findings.schemas import Fp8Public
from ampwatch.server.services.fp8 import fp8_twin

router = APIRouter(prefix="/runs", tags=["series"])


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
