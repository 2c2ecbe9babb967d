"""What every schema of API v1 shares: strict input models, the bounds of steps, layers and
pages, severities, and the error and health answers."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from ampwatch.server.fields import (
    DTYPES,
    INT32_MAX,
    JSON_INT_MAX,
    JsonInt,
    ShortText,
    WireFloat,
    WireFloats,
    name_text,
)
from ampwatch.wire import GUARD_REASONS, LABEL_MAX_CHARS

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



class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    version: str
    database: str
    reason: str | None = Field(None, description="why the database is degraded")



class ValidationErrorPublic(BaseModel):
    """One invalid field (server/errors.py `short_errors`): never the input itself."""

    loc: list[str | int] = Field(description="where: body, query or path, then the field")
    msg: str
    type: str


class ErrorPublic(BaseModel):
    """The body of every error answer."""

    detail: str | list[ValidationErrorPublic] = Field(
        description="what was wrong: a sentence, or the invalid fields (a 422 from validation)")
