"""/api/v1/runs/{run_id}/steps and /layers: a run's data over a step range.

These routes answer with JSON built by server/services/series.py (columns encoded once, no
pydantic pass over thousands of points), so FastAPI does not check it against their
`response_model`: tests/server/test_declared_models.py does. The large answers (steps,
the layer table, the heatmap matrix) hold the read budget while built."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request

from ampwatch.server.api.error_responses import NOT_FOUND, READ
from ampwatch.server.budget import BYTES_PER_STEP_ROW, layers_estimate
from ampwatch.server.deps import RunIdPath, SessionDep
from ampwatch.server.errors import InvalidInput
from ampwatch.server.responses import WireJSONResponse
from ampwatch.server.schemas.common import MAX_STEP
from ampwatch.server.schemas.series import (
    CombinedGradNormsPublic,
    LayerSeriesPublic,
    LayersPublic,
    MatrixPublic,
    RanksPublic,
    StepsPublic,
)
from ampwatch.server.services.ranks import (
    MAX_COMBINED_STEPS,
    MAX_RANKS_PAGE,
    RANKS_PAGE,
    combined_grad_norms,
    expected_ranks,
    grad_layout,
    rank_count,
    rank_page,
    ranks_panel,
)
from ampwatch.server.services.runs import get_run
from ampwatch.server.services.series import (
    layer_series_query,
    layers_query,
    matrix_query,
    steps_query,
)

router = APIRouter(prefix="/runs", tags=["series"])
Start = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="first step (inclusive)")]
End = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="last step (inclusive)")]
Rank = Annotated[int, Query(ge=0, le=1_000_000)]
MaxPoints = Annotated[
    int | None,
    Query(ge=10, le=100_000, description="at most this many points, keeping each bucket's "
          "extremes; every skipped or non-finite step comes apart, in `events`"),
]


@router.get("/{run_id}/steps", operation_id="list_steps", response_model=StepsPublic,
            responses=READ | NOT_FOUND)
def get_steps(
    run_id: RunIdPath,
    session: SessionDep,
    request: Request,
    start: Start = None,
    end: End = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000, description="all ranks if unset")] = None,
    max_points: MaxPoints = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> WireJSONResponse:
    """Per-step records (loss scale, skipped, grad norm, loss, lr, timings, ...)."""
    run = get_run(session, run_id)
    rows = min(limit, max_points or limit)
    with request.app.state.read_budget.hold(rows * BYTES_PER_STEP_ROW):
        return WireJSONResponse(steps_query(session, run, rank=rank, start=start, end=end,
                                            max_points=max_points, limit=limit), encoded=True)


@router.get("/{run_id}/layers", operation_id="list_layers", response_model=LayersPublic,
            responses=READ | NOT_FOUND)
def get_layers(run_id: RunIdPath, session: SessionDep, request: Request, rank: Rank = 0
               ) -> WireJSONResponse:
    """The layer table with per-layer summaries for one rank."""
    run = get_run(session, run_id)
    with request.app.state.read_budget.hold(layers_estimate(run.n_layers)):
        return WireJSONResponse(layers_query(session, run, rank=rank), encoded=True)


MAX_MATRIX_CELLS = 10_000_000  # about 100 MB of JSON: a 10,000-layer run at 1,000 buckets


@router.get("/{run_id}/layers/matrix", operation_id="get_layer_matrix", response_model=MatrixPublic,
            responses=READ | NOT_FOUND)
def get_matrix(
    run_id: RunIdPath,
    session: SessionDep,
    request: Request,
    metric: Literal["grad_norm", "act_absmax", "act_time_ms", "update_ratio", "update_lost",
                    "adam_eps_share", "adam_v_zero_share", "attn_max_logit", "logit_absmax",
                    "logit_lse", "weight_norm"] = "grad_norm",
    rank: Rank = 0,
    start: Start = None,
    end: End = None,
    buckets: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    layer_offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    layer_limit: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
) -> WireJSONResponse:
    """Layers x step buckets for heatmaps: the largest finite value per bucket, or the
    non-finite one when the bucket had one. `layer_offset` and `layer_limit` pick a range
    of layer indices; at most MAX_MATRIX_CELLS layers x buckets in one answer."""
    run = get_run(session, run_id)
    end_layer = run.n_layers if layer_limit is None else min(run.n_layers,
                                                             layer_offset + layer_limit)
    layers = range(layer_offset, max(layer_offset, end_layer))
    if len(layers) * buckets > MAX_MATRIX_CELLS:
        raise InvalidInput(
            f"{len(layers):,} layers x {buckets:,} buckets is more than {MAX_MATRIX_CELLS:,} "
            f"cells: ask for fewer buckets or a range of layers (layer_offset, layer_limit)")
    picked = None if len(layers) == run.n_layers else list(layers)
    with request.app.state.read_budget.hold(layers_estimate(len(layers), buckets)):
        return WireJSONResponse(matrix_query(session, run, metric=metric, rank=rank,
                                             start=start, end=end, buckets=buckets,
                                             layers=picked), encoded=True)


@router.get("/{run_id}/layers/{index}/series", operation_id="get_layer_series",
            response_model=LayerSeriesPublic,
            responses=READ | NOT_FOUND)
def get_layer_series(
    run_id: RunIdPath,
    index: Annotated[int, Path(ge=0, le=1_000_000)],
    session: SessionDep,
    rank: Rank = 0,
    start: Start = None,
    end: End = None,
    max_points: MaxPoints = None,
) -> WireJSONResponse:
    """One layer's grad norm per step and its sampled activation stats."""
    run = get_run(session, run_id)
    return WireJSONResponse(layer_series_query(session, run, index, rank=rank, start=start,
                                               end=end, max_points=max_points), encoded=True)


@router.get("/{run_id}/grad_norms", operation_id="get_grad_norms",
            response_model=CombinedGradNormsPublic,
            responses=READ | NOT_FOUND)
def get_combined_grad_norms(
    run_id: RunIdPath,
    session: SessionDep,
    start: Start = None,
    end: End = None,
    layers: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_COMBINED_STEPS)] = MAX_COMBINED_STEPS,
) -> WireJSONResponse:
    """Grad norms of the whole model combined over the ranks: under FSDP the square root
    of the ranks' summed squares (a step only once every rank sent it), under DDP rank 0's."""
    run = get_run(session, run_id)
    return WireJSONResponse(combined_grad_norms(session, run, start=start, end=end,
                                                with_layers=layers, limit=limit),
                            encoded=True)


@router.get("/{run_id}/ranks", operation_id="list_ranks", response_model=RanksPublic,
            responses=READ | NOT_FOUND)
def get_ranks(
    run_id: RunIdPath,
    session: SessionDep,
    after: Annotated[int, Query(ge=-1, le=2**31 - 1,
                                description="list the ranks numbered above this one")] = -1,
    limit: Annotated[int, Query(ge=1, le=MAX_RANKS_PAGE)] = RANKS_PAGE,
) -> RanksPublic:
    """Each rank side by side: steps, skipped, loss scale, median step time, lost data;
    `limit` ranks at a time (a 16,384-rank run reads in pages: follow `next_after`)."""
    run = get_run(session, run_id)
    rows, next_after = rank_page(session, run.id, after, limit)
    n_ranks = rank_count(session, run.id)
    return RanksPublic(run_id=run.id, world_size=expected_ranks(run, n_ranks),
                       grad_layout=grad_layout(run), n_ranks=n_ranks,
                       items=ranks_panel(session, run, rows), next_after=next_after)
