"""SQLAlchemy 2 models. The schema is created and changed only by Alembic (migrations/).

Per-layer data is the bulk of a run, so it is stored one row per ingested batch with
packed arrays (`Batch`), not one row per layer and step: ingest is one INSERT per batch
and a heatmap of a long run reads a few thousand rows (see server/store/series.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    name: Mapped[str] = mapped_column(String(256), index=True)
    project: Mapped[str] = mapped_column(String(256), index=True)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    environment: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # health from open findings: healthy, warning, critical
    status: Mapped[str] = mapped_column(String(16), default="healthy", index=True)
    open_findings: Mapped[int] = mapped_column(Integer, default=0)
    n_layers: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # no last_seen_at: it is the newest of the ranks' (a per-batch write here made every
    # rank of the run wait on this row); see runs.rank_totals
    # set when the full-resolution data was dropped (summaries and findings are kept)
    archived_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Layer(Base):
    __tablename__ = "layers"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    type: Mapped[str] = mapped_column(String(128))
    param_count: Mapped[int] = mapped_column(BigInteger, default=0)
    dtype: Mapped[str | None] = mapped_column(String(32))
    shapes: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attrs: Mapped[dict[str, Any]] = mapped_column(default=dict)
    forward_index: Mapped[int | None] = mapped_column(Integer)


class RunRank(Base):
    """Running totals of one rank's stream, updated on every ingested batch."""

    __tablename__ = "run_ranks"
    # ingest reads the run's lowest last steps from it
    # (server/services/ingest.py: _all_ranks_through)
    __table_args__ = (Index("ix_run_ranks_last_step", "run_id", "last_step"),)

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    batches: Mapped[int] = mapped_column(Integer, default=0)
    max_seq: Mapped[int] = mapped_column(Integer, default=-1)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    skipped: Mapped[int] = mapped_column(Integer, default=0)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    # finite values only: SQLite turns NaN into NULL
    loss_scale: Mapped[float | None] = mapped_column(Float)
    dropped_batches: Mapped[int] = mapped_column(Integer, default=0)
    dropped_steps: Mapped[int] = mapped_column(Integer, default=0)
    # the last step the rank's training loop said it closed (its agent's heartbeat)
    reached_step: Mapped[int | None] = mapped_column(BigInteger)
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # when the rank's agent detached (its "finished" event); None while it trains
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # median step time of the rank's last steps, kept at ingest (server/store/rollups.py);
    # negative: none of them had one; None: stored before migration 0013
    step_ms_median: Mapped[float | None] = mapped_column(Float)

    @property
    def lost_batches(self) -> int:
        return self.max_seq + 1 - self.batches

    @property
    def missing_steps(self) -> int:
        """Steps of this rank the server does not have: what the agent reported dropped
        (spool bound, full host pool, a crash window), or the holes in the step numbers
        up to the last step, whichever is larger (a hole the agent could not report)."""
        holes = (self.last_step + 1 - self.steps) if self.last_step is not None else 0
        return max(self.dropped_steps, holes, 0)


class Batch(Base):
    """One ingested batch: packed columns of its steps (server/store/series.py)."""

    __tablename__ = "batches"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    n_steps: Mapped[int] = mapped_column(Integer)
    n_layers: Mapped[int] = mapped_column(Integer)
    format: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    scalars: Mapped[bytes] = mapped_column(LargeBinary)
    present: Mapped[bytes] = mapped_column(LargeBinary)
    layer_grad: Mapped[bytes | None] = mapped_column(LargeBinary)
    act_step: Mapped[bytes | None] = mapped_column(LargeBinary)
    act_absmax: Mapped[bytes | None] = mapped_column(LargeBinary)
    act_dtype: Mapped[bytes | None] = mapped_column(LargeBinary)
    act_time: Mapped[bytes | None] = mapped_column(LargeBinary)
    # per sampled step and layer: share of exactly-zero grad elements (MISSING: not counted)
    act_grad_zero: Mapped[bytes | None] = mapped_column(LargeBinary)
    events: Mapped[list[Any] | None] = mapped_column(JSON)
    # a restart sent steps from here on again (a later seq): this batch's copies of them
    # are kept but no longer read (server/store/restarts.py)
    superseded_from: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_batches_run_rank_steps", "run_id", "rank", "first_step"),)


class StepSummary(Base):
    """One bucket of `summaries.SUMMARY_STEPS` steps of a rank, folded as batches arrive
    (server/store/summaries.py): envelope rows and per-layer extremes, compressed."""

    __tablename__ = "step_summaries"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_steps: Mapped[int] = mapped_column(Integer)
    n_layers: Mapped[int] = mapped_column(Integer)
    scalars: Mapped[bytes | None] = mapped_column(LargeBinary)
    present: Mapped[bytes | None] = mapped_column(LargeBinary)
    grad_max: Mapped[bytes | None] = mapped_column(LargeBinary)
    grad_min: Mapped[bytes | None] = mapped_column(LargeBinary)
    act_max: Mapped[bytes | None] = mapped_column(LargeBinary)
    # the step clock (series.with_elapsed): the sum of the bucket's finite t_step_ms, the
    # first folded step's, and each envelope row's sum up to and including it (float64);
    # NULL for a bucket folded before migration 0019 (its steps are read instead)
    step_ms_sum: Mapped[float | None] = mapped_column(Float)
    first_step_ms: Mapped[float | None] = mapped_column(Float)
    elapsed: Mapped[bytes | None] = mapped_column(LargeBinary)


class RankRollup(Base):
    """One of a rank's rollups kept at ingest (server/store/rollups.py): a per-layer statistic
    (float64 per layer: the last and largest grad norm, non-finite counts, ...) or its
    step-time window. One row each, so that a batch rewrites only the ones it changed."""

    __tablename__ = "rank_rollups"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollup: Mapped[int] = mapped_column(Integer, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)


class CombinedNorms(Base):
    """One bucket of `combined.BUCKET_STEPS` step numbers of a sharded run, kept by the
    analysis worker (server/store/combined.py): per step, the ranks folded in (int32), the sum
    of their squared total grad norms (float64) and how many of them sent no total
    (int32), each raw."""

    __tablename__ = "combined_norms"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ranks: Mapped[bytes] = mapped_column(LargeBinary)
    sum_sq: Mapped[bytes] = mapped_column(LargeBinary)
    unknown: Mapped[bytes] = mapped_column(LargeBinary)


class CombinedRank(Base):
    """How far the worker folded one rank of a sharded run into `combined_norms`: every
    step of the rank that reads see, through `through`, exactly once. `stuck` once a
    batch did not simply append (a restart, a late or overlapping batch): the rank is
    folded no further, and reads take its later steps from its batches."""

    __tablename__ = "combined_ranks"
    __table_args__ = (Index("ix_combined_ranks_through", "run_id", "through"),)

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    through: Mapped[int] = mapped_column(BigInteger)
    stuck: Mapped[bool] = mapped_column(Boolean, default=False)


class Fp8Sample(Base):
    """FP8 cast statistics of one sampled step of one rank (server/analysis/fp8.py):
    `layers` the int32 indices of the layers it holds (those the agent measured: the FP8
    layers), `values` float32 (3 roles x 5 statistics x those layers), `present` bool
    (3 roles x those layers), each compressed with server/store/codec.py. Rows stored before
    `layers` existed (NULL) hold every one of `n_layers` layers, raw. A re-sent step
    replaces its row."""

    __tablename__ = "fp8_samples"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_layers: Mapped[int] = mapped_column(Integer)
    values: Mapped[bytes] = mapped_column(LargeBinary)
    present: Mapped[bytes] = mapped_column(LargeBinary)
    layers: Mapped[bytes | None] = mapped_column(LargeBinary)


class SpikeSample(Base):
    """The spike signals of one sampled step of one rank (server/store/spike_samples.py):
    `values` float32 (signals x `n_layers`, NaN where not measured), compressed with
    server/store/codec.py. A re-sent step replaces its row."""

    __tablename__ = "spike_samples"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    n_layers: Mapped[int] = mapped_column(Integer)
    values: Mapped[bytes] = mapped_column(LargeBinary)


class Finding(Base):
    """Something the analysis flagged. A persisting condition updates its open finding
    (matched by `key`) instead of adding rows; a recovered condition resolves it."""

    __tablename__ = "findings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer, default=0)
    kind: Mapped[str] = mapped_column(String(64))
    code: Mapped[str | None] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(512))
    severity: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="open")
    step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    layer: Mapped[str | None] = mapped_column(String(512))
    message: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    count: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (
        Index("ix_findings_run_key", "run_id", "key"),
        Index("ix_findings_severity_status", "severity", "status"),
    )


class AlertNotification(Base):
    """The alert outbox: one notification of one target about one finding event, written
    in the transaction that changed the finding and sent later by a dispatcher
    (server/alerts/dispatcher.py). `payload` is what is sent, frozen at that moment.

    A dispatcher claims a due row by setting `claim` and `claimed_until` in one
    conditional UPDATE, so two replicas never send the same row at once; a claim whose
    lease ran out (its server died) can be taken again.
    """

    __tablename__ = "alert_notifications"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # opened, escalated, resolved, reopened, test
    event: Mapped[str] = mapped_column(String(16))
    rule: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(64))
    finding_id: Mapped[int | None] = mapped_column(Integer, index=True)
    run_id: Mapped[str | None] = mapped_column(String(128))
    severity: Mapped[str | None] = mapped_column(String(16))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # pending, delivered, failed (gave up after the last attempt)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    claim: Mapped[str | None] = mapped_column(String(64))
    claimed_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_alert_notifications_status_due", "status", "next_attempt_at"),
    )


class AlertAttempt(Base):
    """One try at sending a notification, kept for GET /api/v1/alerts/deliveries."""

    __tablename__ = "alert_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    notification_id: Mapped[int] = mapped_column(
        ForeignKey("alert_notifications.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    duration_ms: Mapped[float] = mapped_column(Float)
    ok: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)


class Bundle(Base):
    """A flight-recorder bundle of one bad step (docs/replay.md). The file lies in the
    server's bundle folder (server/services/bundles.py), named by (run, rank, step); the row holds
    what lists and pages show, `meta` the bundle's bundle.json, `bisect` the verdict
    `ampwatch replay --bisect` reported for it (None: none yet)."""

    __tablename__ = "bundles"

    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    trigger: Mapped[str] = mapped_column(String(32))
    first_nonfinite_layer: Mapped[str | None] = mapped_column(String(512))
    exact: Mapped[bool] = mapped_column(Boolean)
    bytes: Mapped[int] = mapped_column(BigInteger)
    meta: Mapped[dict[str, Any]] = mapped_column(default=dict)
    bisect: Mapped[dict[str, Any] | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RunNote(Base):
    """A person's note on a run, or on one of its incidents (`incident`: the incident's id,
    that of its earliest finding); `handled` marks that incident handled."""

    __tablename__ = "run_notes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), index=True
    )
    incident: Mapped[int | None] = mapped_column(Integer)
    handled: Mapped[bool] = mapped_column(Boolean, default=False)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AnalysisTask(Base):
    """A stored batch waiting for the detectors (server/worker/analysis_worker.py),
    enqueued in the batch's own transaction and deleted in the transaction that writes
    its findings. Carries what ingest knew about the rank when it stored the batch, so the
    worker judges it as the request would have."""

    __tablename__ = "analysis_queue"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(BigInteger)
    # the rank's last step before this batch (a restart's: before it); None: it had none
    rank_last_step: Mapped[int | None] = mapped_column(BigInteger)
    # the batch held the rank's newest steps when it was stored
    current: Mapped[bool] = mapped_column(Boolean)
    fp8: Mapped[bool] = mapped_column(Boolean)
    spikes: Mapped[bool] = mapped_column(Boolean)
    # the step every rank had then sent through, when this batch moved it forward
    ranks_through: Mapped[int | None] = mapped_column(BigInteger)
    enqueued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("ix_analysis_queue_run_id_id", "run_id", "id"),)
