"""Flight-recorder bundles as answered, and the verdict `ampwatch replay --bisect`
reports for one (docs/replay.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Self

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ampwatch.server.fields import name_text
from ampwatch.wire.bundles import BisectVerdict

ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=512)]
MAX_MODULES = 1_000
MAX_FIX_CHARS = 64_000  # the code bisect printed: a list of names and a helper
# a whole verdict: its names, fix and reason together (one was 10 MB: 10,000 names of
# 512 characters twice); the bundles list answers at most this a bundle
MAX_VERDICT_CHARS = 64_000


class BisectVerdictCreate(BaseModel):
    """What `ampwatch replay --bisect` found for the bundle's step. `verdict`: `fixed`
    (keeping `modules` in float32 makes the step finite; those of them that are FP8
    layers are also in `fp8_modules`, to keep out of FP8), `not_precision` (every module
    in float32 still fails: the cause is not the precision), `input_nonfinite` (the input
    holds inf/NaN), `not_reproduced` (the step is not bad when replayed). `fix`: the code
    it printed; `reason`: why no upcast fixes the step; `trials`: runs of the step;
    `device`: where they ran; `ran_at`: when the bisect ran; `source`: who ran it, in the
    sender's own words (`ampwatch replay` sends "ampwatch replay VERSION on HOST")."""

    model_config = ConfigDict(extra="forbid")

    verdict: BisectVerdict
    modules: list[ModuleName] = Field(default_factory=list, max_length=MAX_MODULES)
    fp8_modules: list[ModuleName] = Field(default_factory=list, max_length=MAX_MODULES)
    fix: str | None = Field(None, max_length=MAX_FIX_CHARS)
    reason: str | None = Field(None, max_length=2000)
    trials: int = Field(ge=1, le=1_000_000)
    device: str = Field("cpu", min_length=1, max_length=64)
    ran_at: AwareDatetime
    source: name_text(max_length=256) | None = None

    @model_validator(mode="after")
    def _modules_match_the_verdict(self) -> Self:
        if (self.verdict == BisectVerdict.FIXED) != bool(self.modules):
            raise ValueError("modules names the upcast that fixed the step: required with "
                             "verdict 'fixed', empty with any other")
        if not set(self.fp8_modules) <= set(self.modules):
            raise ValueError("fp8_modules must be among modules")
        chars = sum(map(len, self.modules)) + len(self.fix or "") + len(self.reason or "")
        if chars > MAX_VERDICT_CHARS:
            raise ValueError(f"the verdict's names, fix and reason hold {chars} characters, "
                             f"over {MAX_VERDICT_CHARS}")
        return self


class BisectVerdictPublic(BisectVerdictCreate):
    """The verdict as stored, with when the server received it. The server runs no replay:
    `token` is the token the sender held (a short hash of it; null: the server has none,
    so nothing vouches for the sender), `reported_by` says both for people."""

    recorded_at: datetime
    token: str | None = None
    reported_by: str


class BundlePublic(BaseModel):
    """`bisect`: the latest verdict `ampwatch replay --bisect` reported for the bundle
    (null: none yet; a re-sent bundle drops it). `model_factory`: the MODULE:FACTORY the
    run recorded for `ampwatch replay --model` (null: none, or not one replay takes)."""

    run_id: str
    rank: int
    step: int
    trigger: str
    first_nonfinite_layer: str | None
    exact: bool
    bytes: int
    created_at: datetime
    url: str  # the download, relative to the server
    model_factory: str | None = None
    bisect: BisectVerdictPublic | None = None


class BundlesPublic(BaseModel):
    items: list[BundlePublic]
