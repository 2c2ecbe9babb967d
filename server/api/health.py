"""/api/v1/health: liveness and database reachability (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from ampwatch.server import __version__
from ampwatch.server.deps import SessionDep
from ampwatch.server.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/health", response_model=HealthPublic)
def health(session: SessionDep) -> HealthPublic:
    """200 when the server can query its database."""
    session.execute(text("SELECT 1"))
    return HealthPublic(status="ok", version=__version__,
                        database=session.get_bind().dialect.name)
