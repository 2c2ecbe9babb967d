"""A project's runs with their outcomes, and its settings ranked by how well each alone
separates the unhealthy runs (`GET /api/v1/projects/{project}/health`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Outcome = Literal["healthy", "warning", "critical", "no_data"]


class ProjectRunPublic(BaseModel):
    id: str
    name: str
    tags: list[str]
    outcome: Outcome = Field(description="the worst open problem (an incident at warning "
                             "or worse), healthy without one; no_data: no step stored yet")
    first_bad_step: int | None = Field(description="the first step of its first open "
                                       "problem (None: healthy)")
    kinds: list[str] = Field(description="the finding kinds of its open problems")
    steps: int


class FactorSidePublic(BaseModel):
    label: str = Field(description='"lr >= 0.3", "dtype = bf16" or "clip not set"')
    runs: int
    unhealthy: int
    warning: int
    critical: int


class FactorPublic(BaseModel):
    key: str = Field(description="a config key (dotted when nested) or env.<environment key>")
    kind: Literal["numeric", "categorical", "constant"]
    threshold: float | None = Field(description="numeric: the split is key >= threshold "
                                    "against below")
    values: list[Any] = Field(description="categorical: its values, the sides' order")
    sides: list[FactorSidePublic] = Field(description="the runs each side of the split, "
                                          "the worst share of unhealthy runs first")
    summary: str
    score: float = Field(description="information gain over the outcomes' entropy: 1 "
                         "separates exactly, 0 tells nothing")
    chance: float | None = Field(description="share of shuffled outcomes split as well by "
                                 "this key (None: every run has one outcome)")
    separates: bool = Field(description="score above 0 and chance under 0.05")
    credited: bool = Field(description="false: it moves with a key ranked above it")
    confounded_with: list[str] = Field(description="keys that split the runs the same way "
                                       "(or are a monotone function of it)")
    verdict: str


class ProjectHealthPublic(BaseModel):
    project: str
    tag: str | None
    runs: list[ProjectRunPublic] = Field(description="newest first")
    healthy: int
    unhealthy: int
    analysis_pending: int = Field(description="batches of these runs not yet judged: "
                                  "outcomes may still change")
    factors: list[FactorPublic] = Field(description="best separating first")
