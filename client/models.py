"""Typed results of the REST API: frozen dataclasses built from API v1 JSON.

Non-finite floats arrive as "NaN"/"Infinity"/"-Infinity" and become real floats
(wire/floats.py); `None` always means missing. Fields the server adds later are ignored,
so an older client keeps working against a newer server. What every result type shares
(JSON in and out, `Records` and its pandas view) is in model_base.py.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ampwatch.client.model_base import Model, Records, import_pandas
from ampwatch.wire.steps import STEP_FIELDS

SEVERITIES = ("info", "warning", "critical")


@dataclasses.dataclass(frozen=True)
class Health(Model):
    status: str
    version: str
    database: str
    reason: str | None = None  # why the database is degraded


@dataclasses.dataclass(frozen=True)
class RankTotals(Model):
    """One rank's stream of a run."""

    rank: int
    next_seq: int = 0
    batches: int = 0
    lost_batches: int = 0
    steps: int = 0
    skipped: int = 0
    last_step: int | None = None
    loss_scale: float | None = None
    dropped_batches: int = 0
    dropped_steps: int = 0
    missing_steps: int = 0
    # the last step its training loop said it closed (heartbeat); above last_step: lost
    reached_step: int | None = None
    last_seen_at: datetime | None = None
    finished_at: datetime | None = None  # when its agent detached


@dataclasses.dataclass(frozen=True)
class Run(Model):
    """A training run with its totals over all ranks. `status` is its health
    (healthy, warning, critical; no_data before any step arrived); `live` says a batch
    arrived recently and the run has not `finished` (every rank's agent detached)."""

    id: str
    name: str
    project: str
    status: str
    created_at: datetime
    updated_at: datetime
    tags: list[str] = dataclasses.field(default_factory=list)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    live: bool = False
    finished: bool = False  # every rank's agent detached
    # the server's one word for it: waiting, live, stopped (reporting) or finished
    reporting: str = "waiting"
    open_findings: int = 0
    open_problems: int = 0  # open incidents at warning or critical
    open_notes: int = 0  # open info incidents
    analysis_pending: int = 0  # batches not judged yet: findings may still come
    n_layers: int = 0
    steps: int = 0
    skipped: int = 0
    skip_rate: float | None = None
    last_step: int | None = None
    loss_scale: float | None = None
    lost_batches: int = 0
    dropped_batches: int = 0
    dropped_steps: int = 0
    missing_steps: int = 0
    reached_step: int | None = None  # the highest of its ranks'
    steps_lost: int = 0  # trained, never stored: missing ones and those past the last
    last_seen_at: datetime | None = None
    archived_at: datetime | None = None  # per-step data dropped, summaries kept
    n_ranks: int = 0  # every rank that sent anything (`ranks` lists them all here)
    ranks: list[RankTotals] = dataclasses.field(default_factory=list)
    # one line per delivery outage its agents reported (read with one run; [] in lists)
    delivery_outages: list[str] = dataclasses.field(default_factory=list)


# a step's scalars, from their one declaration (wire/steps.py); `rank` first
_STEP_TYPES: dict[str, type] = {"float": float, "bool": bool, "count": int, "step": int,
                                "layer": int, "dtype": str, "guard": str}
Step = dataclasses.make_dataclass(
    "Step", [("rank", int), ("step", int),
             *((f.name, _STEP_TYPES[f.type] | None, dataclasses.field(default=None))
               for f in STEP_FIELDS if f.name != "step")],
    bases=(Model,), frozen=True)
Step.__module__ = __name__  # make_dataclass's module= is Python 3.12's
Step.__doc__ = """One optimizer step of one rank: `rank`, `step` and every per-step scalar
of wire/steps.py (docs/wire-format.md explains each field)."""


@dataclasses.dataclass(frozen=True)
class LayerSummary(Model):
    grad_norm_last: float | None = None
    grad_norm_max: float | None = None
    grad_nonfinite_steps: int = 0
    act_absmax_max: float | None = None
    act_nonfinite_steps: int = 0
    act_dtype: str | None = None
    fwd_time_mean_ms: float | None = None


@dataclasses.dataclass(frozen=True)
class Layer(Model):
    """One row of a run's layer table, with its summary on one rank."""

    index: int
    name: str
    type: str
    param_count: int = 0
    dtype: str | None = None
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    forward_index: int | None = None
    summary: LayerSummary = dataclasses.field(default_factory=LayerSummary)


@dataclasses.dataclass(frozen=True)
class LayerPoint(Model):
    """One step of a layer: its grad norm, or (sampled steps) its activation stats. On a
    zoomed-out read, one bucket of steps from `step`: `grad_norm` its largest (or
    non-finite) grad norm, `grad_norm_min` its smallest."""

    step: int
    grad_norm: float | None = None
    grad_norm_min: float | None = None
    act_absmax: float | None = None
    act_dtype: str | None = None
    act_time_ms: float | None = None
    grad_zero_share: float | None = None  # share of its grad elements exactly zero


@dataclasses.dataclass(frozen=True)
class LayerSeries(Model):
    """One layer's grad norm per step (`grad`) and its sampled activations; downsampled
    (`max_points`), each holds at most that many points and `events` every non-finite
    grad norm and activation abs-max."""

    run_id: str
    rank: int
    layer: int
    name: str
    total: int = 0
    downsampled: bool = False
    grad: Records[LayerPoint] = dataclasses.field(default_factory=Records)
    activations: Records[LayerPoint] = dataclasses.field(default_factory=Records)
    events: Records[LayerPoint] = dataclasses.field(default_factory=Records)


@dataclasses.dataclass(frozen=True)
class LayerMatrix(Model):
    """Layers x step buckets of one metric, for heatmaps: `values[i][j]` is layer
    `layers[i]` over steps `step_start[j]..step_end[j]` (None: no data there)."""

    run_id: str
    rank: int
    metric: str
    layers: list[str] = dataclasses.field(default_factory=list)
    step_start: list[int] = dataclasses.field(default_factory=list)
    step_end: list[int] = dataclasses.field(default_factory=list)
    values: list[list[float | None]] = dataclasses.field(default_factory=list)

    def to_pandas(self) -> Any:
        """A DataFrame with one row per layer and one column per bucket's first step."""
        pandas = import_pandas()
        return pandas.DataFrame(
            [[float("nan") if v is None else v for v in row] for row in self.values],
            index=pandas.Index(self.layers, name="layer"),
            columns=pandas.Index(self.step_start, name="step"),
        )


@dataclasses.dataclass(frozen=True)
class TimelineEntry(Model):
    step: int | None
    what: str
    finding: int
    severity: str


@dataclasses.dataclass(frozen=True)
class Incident(Model):
    """Findings of one root cause (the same rank, cause and layer) told once: `headline`
    and `fix` (None when one finding without a known cause is the whole incident: its
    message says it), steps `step..last_step`, and a `timeline` of its findings.
    `problem`: open and at least a warning."""

    id: int
    run_id: str
    severity: str
    status: str = "open"
    problem: bool = False
    rank: int = 0
    cause: str | None = None
    layer: str | None = None
    step: int | None = None
    last_step: int | None = None
    headline: str | None = None
    fix: str | None = None
    findings: list[int] = dataclasses.field(default_factory=list)
    timeline: list[TimelineEntry] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ProjectRun(Model):
    """A run of a project with its outcome: the worst of its open problems (healthy
    without one; no_data before its first step), the first step of its first problem
    and their finding kinds."""

    id: str
    name: str
    outcome: str
    first_bad_step: int | None = None
    kinds: list[str] = dataclasses.field(default_factory=list)
    tags: list[str] = dataclasses.field(default_factory=list)
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class FactorSide(Model):
    """The runs on one side of a setting's split ("lr >= 0.3") and how many went bad."""

    label: str
    runs: int
    unhealthy: int
    warning: int = 0
    critical: int = 0


@dataclasses.dataclass(frozen=True)
class Factor(Model):
    """A config or environment key (env.<key>) and how well it alone separates a
    project's unhealthy runs: its split (`threshold`: key >= threshold; or `values`),
    `score` (information gain over the outcomes' entropy, 0 to 1), `chance` (share of
    shuffled outcomes split as well) and the keys it is confounded with."""

    key: str
    kind: str
    summary: str
    score: float
    verdict: str
    separates: bool = False
    credited: bool = True
    chance: float | None = None
    threshold: float | None = None
    values: list[Any] = dataclasses.field(default_factory=list)
    sides: list[FactorSide] = dataclasses.field(default_factory=list)
    confounded_with: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ProjectHealth(Model):
    """A project's runs with their outcomes, and its settings ranked best first."""

    project: str
    tag: str | None = None
    runs: list[ProjectRun] = dataclasses.field(default_factory=list)
    healthy: int = 0
    unhealthy: int = 0
    analysis_pending: int = 0
    factors: list[Factor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Finding(Model):
    """Something the analysis flagged in a run: `severity` info/warning/critical,
    `status` open or resolved, steps `step..last_step`, `layer` when one is to blame."""

    id: int
    run_id: str
    kind: str
    severity: str
    message: str
    status: str = "open"
    rank: int = 0
    code: str | None = None
    step: int | None = None
    last_step: int | None = None
    layer: str | None = None
    count: int = 1
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    incident: int | None = None  # id of the incident (root cause) it belongs to

    @property
    def severity_rank(self) -> int:
        """0 for info, 1 for warning, 2 for critical (-1 for an unknown severity)."""
        return SEVERITIES.index(self.severity) if self.severity in SEVERITIES else -1


@dataclasses.dataclass(frozen=True)
class Spike(Model):
    """A loss spike the server found (a `loss_spike` finding, `finding` its id): its first
    and last step, peak, the median it rose from, its likely cause (`label`) with the
    layer, the first step of the precursor and the lead time it gave, the step the loss
    came back (None: not yet), and the fix (docs/spikes.md)."""

    finding: int
    step: int
    rank: int = 0
    end_step: int | None = None
    peak: float | None = None
    median: float | None = None
    ratio: float | None = None
    label: str = "unknown"
    layer: str | None = None
    precursor_step: int | None = None
    lead_steps: int | None = None
    recovered_at: int | None = None
    fix: str | None = None
    incident: int | None = None


@dataclasses.dataclass(frozen=True)
class BisectVerdict(Model):
    """What `ampwatch replay --bisect` found for a bundle's step, as the server keeps it:
    `verdict` fixed (keeping `modules` in float32 makes the step finite; `fp8_modules`
    of them out of FP8), not_precision (every module in float32 still fails),
    input_nonfinite or not_reproduced; `fix` the code it printed, `reason` why no upcast
    helps; `ran_at` when it ran, `recorded_at` when the server got it; `reported_by` who
    sent it (`source`, its own word, and `token`, a short hash of the token it held)."""

    verdict: str
    trials: int
    ran_at: datetime
    recorded_at: datetime
    modules: list[str] = dataclasses.field(default_factory=list)
    fp8_modules: list[str] = dataclasses.field(default_factory=list)
    fix: str | None = None
    reason: str | None = None
    device: str = "cpu"
    source: str | None = None
    token: str | None = None
    reported_by: str = ""


@dataclasses.dataclass(frozen=True)
class BundleInfo(Model):
    """A flight-recorder bundle the server holds: the bad step, what triggered it, the
    first layer whose output held inf/NaN, whether its weights are exact, its size, its
    download `url` (relative to the server), the `model_factory` the run recorded for
    `ampwatch replay --model` (None: none) and the `bisect` verdict reported for it."""

    run_id: str
    rank: int
    step: int
    trigger: str
    first_nonfinite_layer: str | None
    exact: bool
    bytes: int
    created_at: datetime
    url: str
    model_factory: str | None = None
    bisect: BisectVerdict | None = None


@dataclasses.dataclass(frozen=True)
class BatchAck(Model):
    """The server's receipt for one batch; `duplicate` when it already had it."""

    run_id: str
    rank: int
    seq: int
    duplicate: bool
    stored_steps: int


@dataclasses.dataclass(frozen=True)
class AlertTarget(Model):
    """Where notifications go; `url` comes redacted (no tokens or passwords)."""

    name: str
    type: str
    url: str


@dataclasses.dataclass(frozen=True)
class AlertRule(Model):
    name: str
    severity: str
    targets: list[str]
    projects: list[str] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    on_resolve: bool = False
    per: str = "incident"  # one notification per incident, or per finding


@dataclasses.dataclass(frozen=True)
class Alerts(Model):
    """The server's alert rules and targets (docs/alerts.md)."""

    enabled: bool
    public_url: str
    rules: list[AlertRule]
    targets: list[AlertTarget]


@dataclasses.dataclass(frozen=True)
class AlertAttempt(Model):
    attempt: int
    started_at: datetime
    duration_ms: float
    ok: bool
    status_code: int | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Delivery(Model):
    """One notification to one target: `status` pending, delivered or failed, with
    every attempt in `history`."""

    id: int
    event: str
    rule: str
    target: str
    status: str
    title: str
    attempts: int
    created_at: datetime
    finding_id: int | None = None
    run_id: str | None = None
    severity: str | None = None
    next_attempt_at: datetime | None = None
    finished_at: datetime | None = None
    last_error: str | None = None
    history: list[AlertAttempt] = dataclasses.field(default_factory=list)
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)
