"""/api/v1/runs: register, list, read and delete runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from ampwatch.server.api.bodies import json_body_schema, parsed_off_the_loop
from ampwatch.server.api.error_responses import NOT_FOUND, READ, WRITE
from ampwatch.server.api.waits import AnalysisWait
from ampwatch.server.deps import RunIdPath, SessionDep, SettingsDep
from ampwatch.server.fields import NO_NUL
from ampwatch.server.schemas.common import MAX_PAGE_LIMIT, PAGE_LIMIT, Health
from ampwatch.server.schemas.runs import RunPublic, RunsPublic, RunUpsert
from ampwatch.server.services.bundles import remove_bundle_files
from ampwatch.server.services.runs import delete_run, get_run, list_runs, public_run, upsert_run

router = APIRouter(prefix="/runs", tags=["runs"])


@router.put("/{run_id}", operation_id="register_run", response_model=RunPublic, responses=WRITE,
            openapi_extra=json_body_schema(RunUpsert))
def put_run(run_id: RunIdPath,
            body: Annotated[RunUpsert, Depends(parsed_off_the_loop(RunUpsert))],
            session: SessionDep,
            settings: SettingsDep) -> RunPublic:
    """Register a run, or update the fields the body names (idempotent)."""
    run = upsert_run(session, run_id, body, settings)
    return public_run(session, run, settings)


@router.get("", operation_id="list_runs",
            response_model=RunsPublic, responses=READ, dependencies=[AnalysisWait])
def get_runs(
    session: SessionDep,
    settings: SettingsDep,
    project: Annotated[str | None, Query(max_length=256, pattern=NO_NUL)] = None,
    name: Annotated[str | None, Query(max_length=256, pattern=NO_NUL,
                                      description="substring")] = None,
    status: Health | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)] = PAGE_LIMIT,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> RunsPublic:
    """Runs, newest first, filtered by project, name substring and health status."""
    return list_runs(session, settings, project=project, name=name, status=status,
                     limit=limit, offset=offset)


@router.get("/{run_id}", operation_id="get_run",
            response_model=RunPublic, responses=READ | NOT_FOUND,
            dependencies=[AnalysisWait])
def get_one_run(run_id: RunIdPath, session: SessionDep, settings: SettingsDep) -> RunPublic:
    """One run with its totals per rank."""
    return public_run(session, get_run(session, run_id), settings)


@router.delete("/{run_id}", operation_id="delete_run", status_code=204, response_class=Response,
                responses=WRITE | NOT_FOUND)
def remove_run(run_id: RunIdPath, session: SessionDep, settings: SettingsDep) -> Response:
    """Delete the run and all its data (its bundle files too)."""
    delete_run(session, run_id)
    remove_bundle_files(settings, run_id)
    return Response(status_code=204)
