"""A run as registered (`RunUpsert`: its layers, config, environment) and as answered
(`RunPublic`, its ranks' totals)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from ampwatch.server.fields import (
    BigCount,
    Count,
    ShortText,
    WireFloat,
    integer,
    keyed_by_text,
    name_text,
    text,
)
from ampwatch.server.schemas.common import (
    MAX_LAYERS,
    DtypeName,
    Health,
    Label,
    Scalar,
    Strict,
    WireNumber,
    bounded_json,
)

Reporting = Literal["waiting", "live", "stopped", "finished"]


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
    # one word for all of the above (services/runs.run_state): waiting (no batch yet),
    # live, stopped (quiet past `live_seconds` without detaching) or finished
    reporting: Reporting = "waiting"
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
    # steps trained but never stored: missing ones (dropped, holes) and those past the
    # last stored step that the process had reached (its heartbeat)
    steps_lost: int = 0
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


