"""Stored series as answered: steps, layers, a layer's series, the layer matrix, combined grad
norms, the ranks' panel."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    create_model,
)

from ampwatch.server.schemas.common import (
    WireNumber,
)
from ampwatch.wire.steps import STEP_FIELDS, StepField

# Per-step scalars as they are answered, from their one declaration (wire/steps.py)
_PUBLIC_TYPES: dict[str, Any] = {"float": WireNumber, "bool": bool, "count": int, "step": int,
                                 "layer": int, "dtype": str, "guard": str}




def _step_public_field(f: StepField) -> tuple[Any, Any]:
    kind = _PUBLIC_TYPES[f.type]
    if f.type == "step":
        return kind, ...
    return kind | None, None if f.optional else ...




StepPublic = create_model(
    "StepPublic", __module__=__name__,
    __doc__="One step; every declared scalar of StepIn (not the per-layer vectors), and the "
            "rank.",
    rank=(int, ...),
    **{f.name: _step_public_field(f) for f in STEP_FIELDS},
)


class StepsPublic(BaseModel):
    run_id: str
    total: int = Field(description="steps in the requested range, before downsampling")
    count: int
    downsampled: bool
    next_start: int | None = Field(
        description="without max_points: the start of the next page, when `limit` cut it"
    )
    items: list[StepPublic] = Field(description="with max_points: at most that many")
    events: list[StepPublic] = Field(
        [], description="with max_points: every skipped or non-finite step of the range "
        "(also in `items` when downsampling kept it)")


class LayerSummary(BaseModel):
    grad_norm_last: WireNumber | None
    grad_norm_max: WireNumber | None
    grad_nonfinite_steps: int
    act_absmax_max: WireNumber | None
    act_nonfinite_steps: int
    act_dtype: str | None
    fwd_time_mean_ms: WireNumber | None


class LayerPublic(BaseModel):
    index: int
    name: str
    type: str
    param_count: int
    dtype: str | None
    shapes: dict[str, list[int]]
    attrs: dict[str, Any]
    forward_index: int | None
    summary: LayerSummary


class LayersPublic(BaseModel):
    run_id: str
    rank: int
    items: list[LayerPublic]


class LayerPointPublic(BaseModel):
    """One step of a layer; on a zoomed-out read from the step summaries, one bucket of
    steps from `step`: `grad_norm` its largest (or non-finite) grad norm and
    `grad_norm_min` its smallest."""

    step: int
    grad_norm: WireNumber | None
    grad_norm_min: WireNumber | None = None
    act_absmax: WireNumber | None = None
    act_dtype: str | None = None
    act_time_ms: WireNumber | None = None
    grad_zero_share: WireNumber | None = Field(
        None, description="share of the layer's grad elements that were exactly zero")


class LayerSeriesPublic(BaseModel):
    run_id: str
    rank: int
    layer: int
    name: str
    total: int
    downsampled: bool
    grad: list[LayerPointPublic]
    activations: list[LayerPointPublic]
    events: list[LayerPointPublic] = Field(
        [], description="with max_points: every non-finite grad norm and activation "
        "abs-max of the range")


class MatrixPublic(BaseModel):
    run_id: str
    rank: int
    metric: str
    layers: list[str] = Field(description="layer names, one per row of `values`")
    step_start: list[int] = Field(description="first step of each column's bucket")
    step_end: list[int] = Field(description="last step of each column's bucket")
    values: list[list[WireNumber | None]] = Field(
        description="layers x buckets: the largest finite value in the bucket, or the "
        "non-finite value when the bucket had one (NaN before Infinity); null when empty"
    )



class CombinedGradNormsPublic(BaseModel):
    """A run's grad norms combined over its ranks (docs/ranks.md)."""

    run_id: str
    grad_layout: Literal["local", "replicated", "sharded"]
    ranks: int = Field(description="ranks a combined step needs (the run's world size)")
    ranks_reporting: int = Field(description="ranks that sent anything so far")
    steps: list[int]
    grad_norm: list[float | str | None] = Field(
        description="per step, the whole model's grad norm; null when a rank sent none")
    layer_grad_norm: list[list[float | str | None]] | None = Field(
        description="with layers=true: per step, per layer (index order); null: no grad")
    next_start: int | None = Field(description="the start of the next page, when `limit` cut")


class RankPanelPublic(BaseModel):
    rank: int
    steps: int
    skipped: int
    last_step: int | None
    loss_scale: WireNumber | None
    step_ms_median: WireNumber | None
    dropped_steps: int
    lost_batches: int


class RanksPublic(BaseModel):
    run_id: str
    world_size: int
    grad_layout: str
    n_ranks: int = Field(description="every rank of the run that sent a batch")
    items: list[RankPanelPublic] = Field(description="ranks after `after`, lowest first")
    next_after: int | None = Field(
        description="pass as `after` for the next ranks; null: these are the last")


