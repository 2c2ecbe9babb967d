"""Pydantic schemas of API v1, apart from the ORM models. docs/wire-format.md explains
them; non-finite floats travel as "NaN", "Infinity", "-Infinity" in both directions."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from ampwatch.server.fields import (
    INT32_MAX,
    JSON_INT_MAX,
    BigCount,
    Count,
    JsonInt,
    ShortText,
    WireFloat,
    WireFloats,
    integer,
    keyed_by_text,
    name_text,
    text,
)
from ampwatch.server.store.series import DTYPES
from ampwatch.wire import GUARD_REASONS, LABEL_MAX_CHARS
from ampwatch.wire.steps import STEP_FIELDS, StepField

DtypeName = Literal[tuple(name for name in DTYPES if name)]  # type: ignore[valid-type]
GuardReason = Literal[GUARD_REASONS]  # type: ignore[valid-type]
Severity = Literal["info", "warning", "critical"]
Health = Literal["healthy", "warning", "critical", "no_data"]  # no_data: no step stored yet
# A float in an answer: a JSON number, or "NaN", "Infinity" or "-Infinity" (wire form)
WireNumber = float | Literal["NaN", "Infinity", "-Infinity"]
MAX_STEP = JSON_INT_MAX  # steps are stored in float64 columns, which hold it exactly
MAX_LAYERS = 100_000
MAX_STEPS_PER_BATCH = 100_000
# every list of runs or findings: `limit` items per answer unless asked (docs/wire-format.md)
PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
MAX_SEQ = INT32_MAX  # run_ranks.max_seq is an INTEGER column
# A seq this far past the rank's next one is refused (409), so one bad seq cannot turn
# into billions of lost batches for good; an agent that dropped batches stays far below.
MAX_SEQ_GAP = 1_000_000
MAX_CONFIG_BYTES = 64 * 1024  # config and environment, each, as JSON; listed with every run
Scalar = ShortText | JsonInt | WireFloat | bool | None
# a run's name, project or tag: what the agent's `attach` checks (wire/runs.py), and no
# invisible formatting characters either
Label = name_text(1, LABEL_MAX_CHARS)
PerLayer = Annotated[WireFloats, Field(max_length=MAX_LAYERS)]


class Strict(BaseModel):
    """Unknown fields refused; no lax coercion ("12" is not 12, 1 is not true)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def bounded_json(value: Any, field: str) -> Any:
    """`value` when its JSON fits MAX_CONFIG_BYTES (it is returned with every listed run)."""
    if value is None:
        return value
    dumped = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
    size = len(json.dumps(dumped, default=str))
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{field} is {size} bytes as JSON, over the limit of {MAX_CONFIG_BYTES}")
    return value


class ScalerConfig(BaseModel):
    model_config = ConfigDict(strict=True)  # 0 is not false

    init_scale: WireFloat | None = None
    growth_factor: WireFloat | None = None
    backoff_factor: WireFloat | None = None
    growth_interval: Count | None = None
    enabled: bool | None = None


class Environment(BaseModel):
    """What the agent saw at attach; unknown keys are kept as they are."""

    model_config = ConfigDict(extra="allow", strict=True)

    torch_version: ShortText | None = None
    python_version: ShortText | None = None
    ampwatch_version: ShortText | None = None
    device: ShortText | None = None
    device_name: ShortText | None = None
    compute_capability: ShortText | None = None
    autocast_dtype: DtypeName | None = None
    world_size: integer(1, 1_000_000) = 1
    hostname: ShortText | None = None
    scaler: ScalerConfig | None = None


class LayerIn(Strict):
    index: integer(0, MAX_LAYERS - 1)
    name: name_text(1, 512)
    type: name_text(1, 128)
    param_count: BigCount = 0
    dtype: text(max_length=32) | None = None
    shapes: keyed_by_text(list[BigCount]) = {}
    attrs: keyed_by_text(Scalar) = {}
    forward_index: Count | None = None


class RunUpsert(Strict):
    name: Label | None = None
    project: Label | None = None
    tags: list[Label] | None = Field(None, max_length=256)
    config: keyed_by_text(Any) | None = None
    environment: Environment | None = None
    layers: list[LayerIn] | None = Field(None, max_length=MAX_LAYERS, fail_fast=True)

    @field_validator("config", "environment")
    @classmethod
    def _bounded_json(cls, value: Any, info: Any) -> Any:
        return bounded_json(value, info.field_name)

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
    loss_scale: WireNumber | None
    dropped_batches: int
    dropped_steps: int
    missing_steps: int
    # the last step its training loop said it closed (the agent's heartbeat between
    # batches; None: none came); above last_step: steps that had not arrived (yet)
    reached_step: int | None = None
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
    # its stored batches the analysis worker has not judged yet: while above 0, its
    # findings (and so its status) are not all in
    analysis_pending: int
    n_layers: int
    steps: int
    skipped: int
    skip_rate: float | None
    last_step: int | None
    loss_scale: WireNumber | None
    lost_batches: int
    dropped_batches: int
    dropped_steps: int
    missing_steps: int
    reached_step: int | None = None  # the highest of its ranks' (RankPublic.reached_step)
    created_at: datetime
    updated_at: datetime
    last_seen_at: datetime | None
    # its full-resolution steps were dropped (pages read its step summaries)
    archived_at: datetime | None = None
    n_ranks: int  # every rank that sent anything; `ranks` may list fewer (the pages' twins)
    ranks: list[RankPublic]
    # one line per outage its agents reported once delivery recovered (oldest first);
    # read with one run (GET /api/v1/runs/{id}, its pages), empty in lists of runs
    delivery_outages: list[str] = []


class RunsPublic(BaseModel):
    items: list[RunPublic]
    total: int
    limit: int
    offset: int


class ActivationsIn(Strict):
    absmax: PerLayer
    dtype: list[DtypeName | None] | None = Field(None, max_length=MAX_LAYERS, fail_fast=True)
    time_ms: PerLayer | None = None


class Fp8TensorIn(Strict):
    """Per-layer statistics of one tensor role's FP8 cast (L entries each, null where the
    layer does not cast that tensor to FP8 or was not measured)."""

    amax: PerLayer
    scale: PerLayer
    rms: PerLayer
    saturated: PerLayer
    underflow: PerLayer


class Fp8In(Strict):
    """FP8 cast statistics of a sampled step, by tensor role (docs/wire-format.md)."""

    input: Fp8TensorIn | None = None
    weight: Fp8TensorIn | None = None
    grad: Fp8TensorIn | None = None


class SpikesIn(Strict):
    """Per-layer signals that precede loss spikes, on sampled steps (docs/spikes.md); each
    L entries, null where the layer was not measured."""

    update_ratio: PerLayer | None = None
    update_lost: PerLayer | None = None
    adam_eps_share: PerLayer | None = None
    adam_v_zero_share: PerLayer | None = None
    attn_max_logit: PerLayer | None = None
    logit_absmax: PerLayer | None = None
    logit_lse: PerLayer | None = None
    # last: rows stored before it was added hold the signals above only
    weight_norm: PerLayer | None = None


# Per-step scalars as they arrive and as they are answered, from their one declaration
# (wire/steps.py); the per-layer vectors follow them in StepIn.
_IN_TYPES: dict[str, Any] = {"float": WireFloat, "bool": bool, "count": Count,
                             "step": integer(0, MAX_STEP), "layer": integer(0, MAX_LAYERS),
                             "dtype": DtypeName, "guard": GuardReason}
_PUBLIC_TYPES: dict[str, Any] = {"float": WireNumber, "bool": bool, "count": int, "step": int,
                                 "layer": int, "dtype": str, "guard": str}


def _step_in_field(f: StepField) -> tuple[Any, Any]:
    kind = _IN_TYPES[f.type]
    return (kind, ...) if f.type == "step" else (kind | None, None)


def _step_public_field(f: StepField) -> tuple[Any, Any]:
    kind = _PUBLIC_TYPES[f.type]
    if f.type == "step":
        return kind, ...
    return kind | None, None if f.optional else ...


StepIn = create_model(
    "StepIn", __base__=Strict, __module__=__name__,
    __doc__="One step record (docs/wire-format.md): the declared scalars, then per layer.",
    **{f.name: _step_in_field(f) for f in STEP_FIELDS},
    layer_grad_norm=(PerLayer | None, None),
    layer_grad_zero_share=(PerLayer | None, None),
    activations=(ActivationsIn | None, None),
    fp8=(Fp8In | None, None),
    spikes=(SpikesIn | None, None),
)


class EventIn(Strict):
    step: integer(0, MAX_STEP) | None = None
    kind: name_text(1, 64)
    detail: keyed_by_text(Any) = {}


class BatchIn(Strict):
    rank: integer(0, 1_000_000) = 0
    seq: integer(0, MAX_SEQ)
    dropped_batches: Count = 0
    dropped_steps: Count = 0
    # fail_fast: validation stops at the first bad step or event, so an invalid body
    # costs about what a valid one does (docs/security.md)
    steps: list[StepIn] = Field(max_length=MAX_STEPS_PER_BATCH, fail_fast=True)
    events: list[EventIn] = Field([], max_length=10_000, fail_fast=True)

    @model_validator(mode="after")
    def _increasing_steps(self) -> BatchIn:
        for before, after in zip(self.steps, self.steps[1:], strict=False):
            if after.step <= before.step:
                raise ValueError(
                    f"steps must be strictly increasing within a batch: {after.step} "
                    f"follows {before.step}"
                )
        return self


class ReachedIn(Strict):
    """The agent's heartbeat between batches: the last step its training loop closed."""

    reached_step: integer(0, MAX_STEP)


class BatchAck(BaseModel):
    run_id: str
    rank: int
    seq: int
    duplicate: bool
    stored_steps: int


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


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    version: str
    database: str
    reason: str | None = Field(None, description="why the database is degraded")


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


class ValidationErrorPublic(BaseModel):
    """One invalid field (server/errors.py `short_errors`): never the input itself."""

    loc: list[str | int] = Field(description="where: body, query or path, then the field")
    msg: str
    type: str


class ErrorPublic(BaseModel):
    """The body of every error answer."""

    detail: str | list[ValidationErrorPublic] = Field(
        description="what was wrong: a sentence, or the invalid fields (a 422 from validation)")
