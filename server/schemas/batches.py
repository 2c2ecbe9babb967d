"""A batch of steps as the agent sends it (`BatchIn`: per-step scalars from wire/steps.py, per-
layer vectors, FP8 and spike samples) and its acknowledgement."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    Field,
    create_model,
    model_validator,
)

from ampwatch.server.fields import (
    Count,
    WireFloat,
    integer,
    keyed_by_text,
    name_text,
)
from ampwatch.server.schemas.common import (
    MAX_LAYERS,
    MAX_SEQ,
    MAX_STEP,
    MAX_STEPS_PER_BATCH,
    DtypeName,
    GuardReason,
    PerLayer,
    Strict,
)
from ampwatch.wire.steps import STEP_FIELDS, StepField


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



# Per-step scalars as they arrive, from their one declaration (wire/steps.py); the
# per-layer vectors follow them in StepIn.
_IN_TYPES: dict[str, Any] = {"float": WireFloat, "bool": bool, "count": Count,
                             "step": integer(0, MAX_STEP), "layer": integer(0, MAX_LAYERS),
                             "dtype": DtypeName, "guard": GuardReason}


def _step_in_field(f: StepField) -> tuple[Any, Any]:
    kind = _IN_TYPES[f.type]
    return (kind, ...) if f.type == "step" else (kind | None, None)




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


