"""Retention routes: archive a run, compact the database."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from ampwatch.server.api.error_responses import CONFLICT, NOT_FOUND, WRITE, errors
from ampwatch.server.deps import RunIdPath, SessionDep, SettingsDep
from ampwatch.server.schemas.runs import RunPublic
from ampwatch.server.services.retention import archive_run, compact
from ampwatch.server.services.runs import public_run

router = APIRouter(tags=["retention"])


class CompactPublic(BaseModel):
    dialect: str
    bytes_before: int
    bytes_after: int


@router.post("/runs/{run_id}/archive", operation_id="archive_run", response_model=RunPublic,
             responses=WRITE | NOT_FOUND | CONFLICT)
def post_archive(run_id: RunIdPath, session: SessionDep, settings: SettingsDep) -> RunPublic:
    """Drop the run's full-resolution steps and FP8 samples, keep its summaries (built
    first from its steps when it was stored without them; 409 when they cannot be),
    layers, findings, totals and agent events."""
    return public_run(session, archive_run(session, run_id), settings)


# no parameters, so no 422
@router.post("/storage/compact", operation_id="compact_storage", response_model=CompactPublic,
             responses=errors(400, 403, 408, 413, 415, 503, 507))
def post_compact(request: Request, session: SessionDep) -> CompactPublic:
    """Hand the space of deleted and archived runs back to the file system (SQLite:
    VACUUM, which rewrites the file and can take minutes on a large database, while
    ingest waits for it)."""
    return CompactPublic(**compact(request.app.state.engine, session))
