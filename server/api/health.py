"""/api/v1/health: liveness and database state (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy import text

from ampwatch.server import __version__
from ampwatch.server.deps import SessionDep, SettingsDep
from ampwatch.server.faults import (
    DATABASE_ERRORS,
    DatabaseUnavailable,
    DiskFull,
    database_error,
)
from ampwatch.server.http.guards import token_scheme
from ampwatch.server.responses import WireJSONResponse
from ampwatch.server.schemas.common import HealthPublic

router = APIRouter(tags=["health"])
DISK_FULL = "the database's disk is full (send the token for details)"
UNAVAILABLE = "the database cannot be used (send the token for details)"


@router.get("/health", operation_id="get_health", response_model=HealthPublic,
            responses={503: {"model": HealthPublic, "description": "database degraded"}})
def health(request: Request, session: SessionDep, settings: SettingsDep) -> WireJSONResponse:
    """200 when the database answers and the last write succeeded; 503 with the reason
    when it does not answer, its file is gone, or writes fail (e.g. a full disk). With a
    token set, a request without it gets only the kind of fault: the driver's message can
    name the database's host, port, user or file."""
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
    if reason and settings.token is not None and token_scheme(
            request.headers, request.cookies, settings.token) is None:
        reason = DISK_FULL if reason.startswith(DiskFull.PREFIX) else UNAVAILABLE
    body = HealthPublic(status="degraded" if reason else "ok", version=__version__,
                        database=backend, reason=reason)
    return WireJSONResponse(body.model_dump(), status_code=503 if reason else 200)
