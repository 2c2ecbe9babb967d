"""/api/v1/projects: a project's runs with their outcomes, and the settings that
separate the runs that went bad."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import ProjectPath, SessionDep
from ampwatch.server.fields import NO_NUL
from ampwatch.server.schemas.projects import ProjectHealthPublic
from ampwatch.server.services.projects import project_health

router = APIRouter(prefix="/projects", tags=["projects"])


@router.get("/{project:path}/health", operation_id="get_project_health",
            response_model=ProjectHealthPublic, responses=READ | NOT_FOUND,
            dependencies=[AnalysisWait])
def get_project_health(
    project: ProjectPath,
    session: SessionDep,
    tag: Annotated[str | None, Query(max_length=256, pattern=NO_NUL,
                                     description="only runs with this tag")] = None,
) -> ProjectHealthPublic:
    """Every run of the project, newest first, with its outcome (the worst of its open
    problems), the first step of its first problem and their kinds; and each config and
    environment key ranked by how well it alone separates the unhealthy runs from the
    healthy ones (decision stumps scored by information gain, checked against shuffled
    outcomes; docs/projects.md), keys that move together flagged as confounded."""
    return project_health(session, project, tag=tag)
