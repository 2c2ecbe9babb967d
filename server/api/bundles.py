"""/api/v1/runs/{run_id}/bundles: the flight recorder's bad steps (docs/replay.md).

The upload streams to a file (a bundle holds a model: far over the JSON body limit):
RequestBodyMiddleware passes this one path through and http/bundle_upload.py writes it to
a file, under `bundle_max_bytes` and `bundle_timeout_s`, before the request takes a slot.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from ampwatch.server.api.error_responses import NOT_FOUND, READ, WRITE
from ampwatch.server.budget import BYTES_PER_BUNDLE
from ampwatch.server.deps import RunIdPath, SessionDep, SettingsDep
from ampwatch.server.errors import InvalidInput
from ampwatch.server.http.bundle_upload import BUNDLE_TYPES, UPLOADED_BUNDLE
from ampwatch.server.models import utcnow
from ampwatch.server.schemas.bundles import (
    BisectVerdictCreate,
    BundlePublic,
    BundlesPublic,
)
from ampwatch.server.services.bundles import (
    bundle_count,
    get_bundle,
    list_bundles,
    public_bundle,
    record_bisect,
    store_bundle,
    token_identity,
)
from ampwatch.server.services.runs import get_run

router = APIRouter(prefix="/runs", tags=["bundles"])
Rank = Annotated[int, Path(ge=0, le=1_000_000)]
Step = Annotated[int, Path(ge=0, le=2**62)]


BUNDLE_BODY = {"requestBody": {"required": True, "content": {
    media: {"schema": {"type": "string", "format": "binary"}} for media in BUNDLE_TYPES}}}


@router.put("/{run_id}/bundles/{rank}/{step}", operation_id="upload_bundle",
            response_model=BundlePublic,
            responses=WRITE | NOT_FOUND, openapi_extra=BUNDLE_BODY)
async def put_bundle(run_id: RunIdPath, rank: Rank, step: Step, request: Request,
                     settings: SettingsDep) -> Any:
    """Upload a bundle (the file's bytes, `Content-Type: application/zip`); a re-sent
    step replaces it. 404 for a run the server does not know (before reading the body),
    413 over `bundle_max_bytes`, 408 when the whole upload takes over `bundle_timeout_s`,
    507 past `bundle_total_bytes`."""
    sessionmaker = request.app.state.sessionmaker

    def store() -> BundlePublic:
        with sessionmaker() as session:
            get_run(session, run_id)
            media = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if media not in BUNDLE_TYPES:
                raise InvalidInput(f"Content-Type must be one of {', '.join(BUNDLE_TYPES)}")
            upload = request.scope.get(UPLOADED_BUNDLE)
            if upload is None:  # the run was created while its body was refused unread
                raise InvalidInput("the bundle was not received: send it again")
            return public_bundle(store_bundle(session, settings, run_id, rank, step, upload))

    return await run_in_threadpool(store)


@router.get("/{run_id}/bundles", operation_id="list_bundles",
            response_model=BundlesPublic, responses=READ | NOT_FOUND)
def get_bundles(run_id: RunIdPath, session: SessionDep, request: Request) -> BundlesPublic:
    """The run's bundles, by step: trigger, first non-finite layer, exactness, size, the
    bisect verdict; at most MAX_BUNDLES_PER_RUN."""
    get_run(session, run_id)
    with request.app.state.read_budget.hold(bundle_count(session, run_id) * BYTES_PER_BUNDLE):
        return BundlesPublic(items=[public_bundle(b) for b in list_bundles(session, run_id)])


@router.get("/{run_id}/bundles/{rank}/{step}", operation_id="download_bundle",
            response_class=FileResponse,
            responses=READ | NOT_FOUND)
def download_bundle(run_id: RunIdPath, rank: Rank, step: Step, session: SessionDep,
                    settings: SettingsDep) -> FileResponse:
    """The bundle file (`ampwatch replay` reads it)."""
    _, path = get_bundle(session, settings, run_id, rank, step)
    return FileResponse(path, media_type="application/zip", filename=path.name)


# HEAD answers what GET would (size, type, name) without the body: download managers and
# `curl -I` ask before fetching a large bundle
router.head("/{run_id}/bundles/{rank}/{step}", include_in_schema=False)(download_bundle)


@router.put("/{run_id}/bundles/{rank}/{step}/bisect", operation_id="record_bisect",
            response_model=BundlePublic, responses=WRITE | NOT_FOUND)
def put_bisect(run_id: RunIdPath, rank: Rank, step: Step, body: BisectVerdictCreate,
               session: SessionDep, settings: SettingsDep) -> BundlePublic:
    """Record what `ampwatch replay --bisect` found for a bundle's step (it sends this
    itself for a bundle of this server); a later verdict replaces it. The run's incident
    that the bundle belongs to then gives the fix the bisect found. 404 for a bundle the
    server does not hold; 422 for a verdict that contradicts itself (modules with a
    verdict other than `fixed`), nothing stored. The verdict keeps who sent it: its
    `source` and the token it came with (`reported_by`)."""
    token = settings.token and token_identity(settings.token)  # the require_token passed
    verdict = {**body.model_dump(mode="json"), "recorded_at": utcnow().isoformat(),
               "token": token}
    return public_bundle(record_bisect(session, settings, run_id, rank, step, verdict))
