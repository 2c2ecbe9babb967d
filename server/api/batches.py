"""/api/v1/runs/{run_id}/batches: ingest from the agent."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.runs import RunIdPath
from server.deps import SessionDep, SettingsDep
from server.ingest import ingest_batch
from server.schemas import BatchAck, BatchIn

router = APIRouter(prefix="/runs", tags=["ingest"])


@router.post("/{run_id}/batches", response_model=BatchAck)
def post_batch(run_id: RunIdPath, batch: BatchIn, session: SessionDep,
               settings: SettingsDep) -> BatchAck:
    """Store one batch of steps from one rank (gzip bodies welcome).

    Committed whole or not at all; a repeated (run, rank, seq) is acknowledged with
    `duplicate: true` and ignored; a gap in seq is counted as lost batches.
    """
    return ingest_batch(session, run_id, batch, settings)
