"""/api/v1/runs/{run_id}/batches: ingest from the agent."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from ampwatch.server.api.bodies import json_body_schema, parsed_off_the_loop
from ampwatch.server.api.error_responses import CONFLICT, NOT_FOUND, WRITE
from ampwatch.server.deps import RunIdPath, SessionDep, SettingsDep
from ampwatch.server.schemas.batches import BatchAck, BatchIn, ReachedIn
from ampwatch.server.services.heartbeats import note_reached_step
from ampwatch.server.services.ingest import ingest_batch

router = APIRouter(prefix="/runs", tags=["ingest"])


@router.post(
    "/{run_id}/batches", operation_id="send_batch",
    response_model=BatchAck,
    responses=WRITE | NOT_FOUND | CONFLICT,
    openapi_extra=json_body_schema(BatchIn),
)
def post_batch(run_id: RunIdPath, batch: Annotated[BatchIn, Depends(parsed_off_the_loop(BatchIn))],
               session: SessionDep, settings: SettingsDep, request: Request,
               made_at: datetime | None = None) -> BatchAck:
    """Store one batch of steps from one rank (gzip bodies welcome).

    Committed whole or not at all; a repeated (run, rank, seq) is acknowledged with
    `duplicate: true` and ignored; a gap in seq is counted as lost batches. `made_at`:
    when the batch's data was made, for a batch sent late (`ampwatch sync` sends the
    spool file's time): the rank's last seen time becomes it, not the upload's, so a
    late upload never makes a run that stopped reporting live again.
    """
    metrics, worker = request.app.state.metrics, request.app.state.analysis_worker
    if made_at is not None and made_at.tzinfo is None:
        made_at = made_at.replace(tzinfo=UTC)
    ack = ingest_batch(session, run_id, batch, settings,
                       hand_over=None if worker is None else worker.windows.offer,
                       made_at=made_at)
    metrics.batch_acknowledged(ack)
    return ack


@router.post("/{run_id}/ranks/{rank}/reached", operation_id="send_reached_step",
             status_code=204, responses=WRITE | NOT_FOUND)
def post_reached_step(run_id: RunIdPath, rank: Annotated[int, Path(ge=0, le=1_000_000)],
                      body: ReachedIn, session: SessionDep) -> None:
    """The last step a rank's training loop closed, sent between batches: after a kill,
    the steps past the last stored one are told as lost (never stored as steps). 422,
    nothing stored, for a step the rank cannot have reached by now (docs/security.md)."""
    note_reached_step(session, run_id, rank, body.reached_step)
