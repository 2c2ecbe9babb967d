"""Pydantic schemas of API v1, apart from the ORM models. docs/wire-format.md explains
them; non-finite floats travel as "NaN", "Infinity", "-Infinity" in both directions."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ampwatch.client.wire import LABEL_MAX_CHARS, LABEL_PATTERN, RUN_ID_PATTERN
from ampwatch.server.series import DTYPES

RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]
DtypeName = Literal[tuple(name for name in DTYPES if name)]  # type: ignore[valid-type]
Severity = Literal["info", "warning", "critical"]
Health = Literal["healthy", "warning", "critical", "no_data"]  # no_data: no step stored yet
MAX_STEP = 2**53  # steps are stored in float64 columns
MAX_LAYERS = 100_000
MAX_STEPS_PER_BATCH = 100_000
# every list of runs or findings: `limit` items per answer unless asked (docs/wire-format.md)
PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
ShortText = Annotated[str, StringConstraints(max_length=256)]
Scalar = str | int | float | bool | None
# a run's name, project or tag: what the agent's `attach` checks too (client/wire.py)
Label = Annotated[str, StringConstraints(min_length=1, max_length=LABEL_MAX_CHARS,
                                         pattern=LABEL_PATTERN)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScalerConfig(BaseModel):
    init_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    enabled: bool | None = None


class Environment(BaseModel):
    """What the agent saw at attach; unknown keys are kept as they are."""

    model_config = ConfigDict(extra="allow")

    torch_version: ShortText | None = None
    python_version: ShortText | None = None
    ampwatch_version: ShortText | None = None
    device: ShortText | None = None
    device_name: ShortText | None = None
    compute_capability: ShortText | None = None
    autocast_dtype: DtypeName | None = None
    world_size: int = Field(1, ge=1, le=1_000_000)
    hostname: ShortText | None = None
    scaler: ScalerConfig | None = None


class LayerIn(Strict):
    index: int = Field(ge=0, lt=MAX_LAYERS)
    name: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    type: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    param_count: int = Field(0, ge=0)
    dtype: ShortText | None = None
    shapes: dict[ShortText, list[Annotated[int, Field(ge=0)]]] = {}
    attrs: dict[ShortText, Scalar] = {}
    forward_index: int | None = Field(None, ge=0)


class RunUpsert(Strict):
    name: Label | None = None
    project: Label | None = None
    tags: list[Label] | None = Field(None, max_length=256)
    config: dict[str, Any] | None = None
    environment: Environment | None = None
    layers: list[LayerIn] | None = Field(None, max_length=MAX_LAYERS)

    @model_validator(mode="after")
    def _dense_layer_indices(self) -> RunUpsert:
        if self.layers is not None:
            indices = sorted(layer.index for layer in self.layers)
            if indices != list(range(len(indices))):
                raise ValueError("layers[].index must be 0..L-1, each exactly once")
        return self


class RankPublic(BaseModel):
    rank: int
    next_seq: int
    batches: int
    lost_batches: int
    steps: int
    skipped: int
    last_step: int | None
    loss_scale: float | None
    dropped_batches: int
    dropped_steps: int
    missing_steps: int
    last_seen_at: datetime | None
    finished_at: datetime | None = None  # when its agent detached


class RunPublic(BaseModel):
    id: str
    name: str
    project: str
    tags: list[str]
    config: dict[str, Any]
    environment: dict[str, Any]
    status: Health
    live: bool  # a batch arrived within `live_seconds` and not every rank has finished
    finished: bool = False  # every rank's agent detached (and sent no step since)
    open_findings: int
    # open incidents (findings grouped by root cause): warning or critical ones, info ones
    open_problems: int = 0
    open_notes: int = 0
    n_layers: int
    steps: int
    skipped: int
    skip_rate: float | None
    last_step: int | None
    loss_scale: float | None
    lost_batches: int
    dropped_batches: int
    dropped_steps: int
    missing_steps: int
    created_at: datetime
    updated_at: datetime
    last_seen_at: datetime | None
    # its full-resolution steps were dropped (pages read its step summaries)
    archived_at: datetime | None = None
    ranks: list[RankPublic]


class RunsPublic(BaseModel):
    items: list[RunPublic]
    total: int
    limit: int
    offset: int


class ActivationsIn(Strict):
    absmax: list[float | None]
    dtype: list[DtypeName | None] | None = None
    time_ms: list[float | None] | None = None


class Fp8TensorIn(Strict):
    """Per-layer statistics of one tensor role's FP8 cast (L entries each, null where the
    layer does not cast that tensor to FP8 or was not measured)."""

    amax: list[float | None] = Field(max_length=MAX_LAYERS)
    scale: list[float | None] = Field(max_length=MAX_LAYERS)
    rms: list[float | None] = Field(max_length=MAX_LAYERS)
    saturated: list[float | None] = Field(max_length=MAX_LAYERS)
    underflow: list[float | None] = Field(max_length=MAX_LAYERS)


class Fp8In(Strict):
    """FP8 cast statistics of a sampled step, by tensor role (docs/wire-format.md)."""

    input: Fp8TensorIn | None = None
    weight: Fp8TensorIn | None = None
    grad: Fp8TensorIn | None = None


class StepIn(Strict):
    step: int = Field(ge=0, le=MAX_STEP)
    loss_scale: float | None = None
    scale_after: float | None = None
    skipped: bool | None = None
    grad_norm: float | None = None
    grad_norm_clipped: float | None = None
    loss: float | None = None
    lr: float | None = None
    t_forward_ms: float | None = None
    t_backward_ms: float | None = None
    t_optimizer_ms: float | None = None
    t_step_ms: float | None = None
    peak_mem_bytes: float | None = None
    input_nonfinite: bool | None = None
    forward_nonfinite: bool | None = None
    first_nonfinite_layer: int | None = Field(None, ge=0, le=MAX_LAYERS)
    autocast_dtype: DtypeName | None = None
    scheduler_steps: int | None = Field(None, ge=0)
    scaler_updates: int | None = Field(None, ge=0)
    clip_before_unscale: bool | None = None
    eval_forwards: int | None = Field(None, ge=0)
    eval_forwards_no_autocast: int | None = Field(None, ge=0)
    layer_grad_norm: list[float | None] | None = Field(None, max_length=MAX_LAYERS)
    layer_grad_zero_share: list[float | None] | None = Field(None, max_length=MAX_LAYERS)
    activations: ActivationsIn | None = None
    fp8: Fp8In | None = None


class EventIn(Strict):
    step: int | None = Field(None, ge=0, le=MAX_STEP)
    kind: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    detail: dict[str, Any] = {}


class BatchIn(Strict):
    rank: int = Field(0, ge=0, le=1_000_000)
    seq: int = Field(ge=0, le=2**62)
    dropped_batches: int = Field(0, ge=0)
    dropped_steps: int = Field(0, ge=0)
    steps: list[StepIn] = Field(max_length=MAX_STEPS_PER_BATCH)
    events: list[EventIn] = Field([], max_length=10_000)

    @model_validator(mode="after")
    def _increasing_steps(self) -> BatchIn:
        for before, after in zip(self.steps, self.steps[1:], strict=False):
            if after.step <= before.step:
                raise ValueError(
                    f"steps must be strictly increasing within a batch: {after.step} "
                    f"follows {before.step}"
                )
        return self


class BatchAck(BaseModel):
    run_id: str
    rank: int
    seq: int
    duplicate: bool
    stored_steps: int


class StepPublic(BaseModel):
    """One step; every field of StepIn but the per-layer vectors, plus the rank."""

    rank: int
    step: int
    loss_scale: float | None
    scale_after: float | None
    skipped: bool | None
    grad_norm: float | None
    grad_norm_clipped: float | None
    loss: float | None
    lr: float | None
    t_forward_ms: float | None
    t_backward_ms: float | None
    t_optimizer_ms: float | None
    t_step_ms: float | None
    peak_mem_bytes: float | None
    input_nonfinite: bool | None
    forward_nonfinite: bool | None = None
    first_nonfinite_layer: int | None = None
    autocast_dtype: str | None
    scheduler_steps: int | None
    scaler_updates: int | None
    clip_before_unscale: bool | None
    eval_forwards: int | None
    eval_forwards_no_autocast: int | None


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
    grad_norm_last: float | None
    grad_norm_max: float | None
    grad_nonfinite_steps: int
    act_absmax_max: float | None
    act_nonfinite_steps: int
    act_dtype: str | None
    fwd_time_mean_ms: float | None


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
    grad_norm: float | None
    grad_norm_min: float | None = None
    act_absmax: float | None = None
    act_dtype: str | None = None
    act_time_ms: float | None = None


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
    values: list[list[float | None]] = Field(
        description="layers x buckets: the largest finite value in the bucket, or the "
        "non-finite value when the bucket had one (NaN before Infinity); null when empty"
    )


class HealthPublic(BaseModel):
    status: Literal["ok"]
    version: str
    database: str


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
    loss_scale: float | None
    step_ms_median: float | None
    dropped_steps: int
    lost_batches: int


class RanksPublic(BaseModel):
    run_id: str
    world_size: int
    grad_layout: str
    items: list[RankPanelPublic]
