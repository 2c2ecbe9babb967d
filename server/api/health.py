"""/api/v1/health: liveness and database state (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy import text

from ampwatch.server import __version__
from ampwatch.server.deps import SessionDep
from ampwatch.server.faults import DATABASE_ERRORS, DatabaseUnavailable, database_error
from ampwatch.server.responses import WireJSONResponse
from ampwatch.server.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/health", response_model=HealthPublic,
            responses={503: {"model": HealthPublic, "description": "database degraded"}})
def health(request: Request, session: SessionDep) -> WireJSONResponse:
    """200 when the database answers and the last write succeeded; 503 with the reason
    when it does not answer, its file is gone, or writes fail (e.g. a full disk)."""
    backend = session.get_bind().dialect.name
    reason = None
    try:
        session.execute(text("SELECT 1"))
        watch = session.info.get("file_watch")
        if watch is not None:
            watch.check()
    except DatabaseUnavailable as exc:
        reason = exc.message
    except DATABASE_ERRORS as exc:
        reason = database_error(exc).message
    reason = reason or request.app.state.db_health.failure
    body = HealthPublic(status="degraded" if reason else "ok", version=__version__,
                        database=backend, reason=reason)
    return WireJSONResponse(body.model_dump(), status_code=503 if reason else 200)
