"""Step-bucket summaries: what a long run's zoomed-out pages read instead of every step.

Each rank's steps are cut into buckets of `SUMMARY_STEPS` consecutive step numbers. A
bucket keeps, folded in as batches arrive (one upsert per touched bucket, no history read):

- the *envelope rows*: the full scalar rows of the steps where loss scale, grad norm and
  loss reach their minimum and maximum in the bucket, plus every skipped or non-finite
  step (so downsampling a range of buckets keeps the same extremes and anomalies that
  downsampling the raw steps keeps);
- per layer, the largest grad norm (NaN, else inf, when the bucket had one: the heatmap
  rule of `downsample.bucket_matrix`), the smallest finite grad norm, and the largest
  activation abs-max.

About 12 KB per bucket of a 1,000-layer run (compressed), so 1,000,000 steps keep 12 MB
of summaries next to about 3 GB of full-resolution data; archiving a run drops the latter.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from ampwatch.server.models import StepSummary
from ampwatch.server.store.codec import decode_column, encode_array
from ampwatch.server.store.downsample import always_kept
from ampwatch.server.store.series import MISSING, SCALAR_FIELDS, StepSeries
from ampwatch.server.store.storage import clip_steps

SUMMARY_STEPS = 1000
ENVELOPE_FIELDS = ("loss_scale", "grad_norm", "loss")
_K = len(SCALAR_FIELDS)


def envelope_index(series: StepSeries) -> np.ndarray:
    """Positions of the rows a bucket keeps: the steps downsampling always keeps (skipped
    or non-finite), and each envelope field's minimum and maximum."""
    keep = always_kept(series)
    for name in ENVELOPE_FIELDS:
        col = series.column(name)
        finite = series.has(name) & np.isfinite(col)
        if finite.any():
            where = np.flatnonzero(finite)
            keep[where[col[where].argmin()]] = True
            keep[where[col[where].argmax()]] = True
    return np.flatnonzero(keep)


def step_ms(series: StepSeries) -> np.ndarray:
    """Each step's `t_step_ms` as the step clock counts it: 0 where missing or non-finite."""
    times = series.column("t_step_ms")
    return np.where(series.has("t_step_ms") & np.isfinite(times), times, 0.0)


def _layer_fold(old_max, old_min, block):
    """Fold a (steps, L) float32 block into per-layer (max, min): max propagates NaN and
    inf and ignores MISSING; min is over finite present values (MISSING: none)."""
    big = block.max(axis=0)  # MISSING (-1) loses to every real value; NaN propagates
    present = block != MISSING
    finite = present & np.isfinite(block)
    small = np.where(finite, block, np.inf).min(axis=0)
    small = np.where(np.isfinite(small), small, MISSING).astype(np.float32)
    if old_max is None:
        return big, small
    merged_min = np.where(old_min == MISSING, small,
                          np.where(small == MISSING, old_min, np.minimum(old_min, small)))
    return np.maximum(old_max, big), merged_min.astype(np.float32)


def _decode(data: bytes | None, dtype, shape) -> np.ndarray | None:
    if data is None:
        return None
    return np.frombuffer(decode_column(data, np.dtype(dtype).itemsize), dtype=dtype).reshape(shape)


def _encode(array: np.ndarray | None) -> bytes | None:
    return None if array is None else encode_array(array)


# built once: it runs for every batch
_BUCKETS = select(StepSummary).where(
    StepSummary.run_id == bindparam("run_id"), StepSummary.rank == bindparam("rank"),
    StepSummary.bucket.in_(bindparam("buckets", expanding=True)))


def fold_batch(session: Session, run_id: str, rank: int, batch: StepSeries) -> None:
    """Fold a just-stored batch into its rank's bucket summaries (inside the ingest
    transaction); reads and rewrites only the buckets the batch touches."""
    if not len(batch):
        return
    steps = batch.steps
    buckets = steps // SUMMARY_STEPS
    existing = {row.bucket: row for row in session.scalars(_BUCKETS, {
        "run_id": run_id, "rank": rank, "buckets": np.unique(buckets).tolist()})}
    width = batch.n_layers
    for bucket in np.unique(buckets).tolist():
        part = batch.take(np.flatnonzero(buckets == bucket))
        part = part.take(np.argsort(part.steps, kind="stable"))
        old = row = existing.get(bucket)
        if row is None or row.n_layers != width:
            row = _replace(session, row, run_id, rank, bucket, width)
        part_ms = step_ms(part)
        if old is None:  # a new bucket starts its clock (one restarted at a new width has none)
            row.step_ms_sum, row.first_step_ms = 0.0, float(part_ms[0])
        kept = _decode(row.scalars, np.float64, (-1, _K))
        if kept is not None:
            present = _decode(row.present, np.bool_, (-1, _K))
            union = StepSeries(np.concatenate([kept, part.scalars]),
                               np.concatenate([present, part.present]), None,
                               np.zeros(0, np.int64), None, None, None, width)
        else:
            union = part
        # callers fold a bucket's steps in step order (ingest refolds a batch that repeats
        # stored steps), so the part's running sums follow every kept row's
        elapsed = None
        if row.step_ms_sum is not None:
            before = _decode(row.elapsed, np.float64, (-1,))
            elapsed = np.concatenate([np.zeros(0) if before is None else before,
                                      row.step_ms_sum + np.cumsum(part_ms)])
            row.step_ms_sum += float(part_ms.sum())
        order = np.argsort(union.steps, kind="stable")
        union = union.take(order)
        keep = envelope_index(union)
        union = union.take(keep)
        row.scalars, row.present = _encode(union.scalars), _encode(union.present)
        row.elapsed = None if elapsed is None else _encode(elapsed[order][keep])
        row.n_steps += len(part)
        if part.layer_grad is not None:
            grad_max, grad_min = _layer_fold(_decode(row.grad_max, np.float32, (width,)),
                                             _decode(row.grad_min, np.float32, (width,)),
                                             part.layer_grad)
            row.grad_max, row.grad_min = _encode(grad_max), _encode(grad_min)
        if part.act_absmax is not None and part.act_absmax.size:
            act_max, _ = _layer_fold(_decode(row.act_max, np.float32, (width,)),
                                     _decode(row.act_max, np.float32, (width,)),
                                     part.act_absmax)
            row.act_max = _encode(act_max)


def _replace(session: Session, row: StepSummary | None, run_id: str, rank: int, bucket: int,
             width: int) -> StepSummary:
    """A fresh summary row (the layer table changed width: the bucket starts over)."""
    if row is not None:
        session.delete(row)
        session.flush()
    row = StepSummary(run_id=run_id, rank=rank, bucket=bucket, n_layers=width, n_steps=0)
    session.add(row)
    return row


LAYER_BLOCKS = ("grad_max", "grad_min", "act_max")


def load_summaries(session: Session, run_id: str, rank: int, start: int | None,
                   end: int | None, n_layers: int, layers: np.ndarray | None = None, *,
                   envelope: bool = True,
                   blocks: tuple[str, ...] = LAYER_BLOCKS) -> SimpleNamespace:
    """The rank's buckets overlapping [start, end]: `n_steps`, `bucket_start` (m,), with
    `envelope` the envelope rows within the range (a StepSeries), and each of `blocks`
    ((m, n_layers) float32, MISSING where a bucket had none; with `layers` (indices),
    only those layers' columns, in that order). Reads and decompresses only those
    columns: a 1,000,000-step run has 1,000 buckets of about 12 KB each."""
    columns = np.arange(n_layers) if layers is None else layers
    selected = [getattr(StepSummary, name) for name in blocks]
    if envelope:
        selected += [StepSummary.scalars, StepSummary.present]
    query = select(StepSummary.bucket, StepSummary.n_steps, StepSummary.n_layers,
                   *selected).where(StepSummary.run_id == run_id, StepSummary.rank == rank)
    if start is not None:
        query = query.where(StepSummary.bucket >= start // SUMMARY_STEPS)
    if end is not None:
        query = query.where(StepSummary.bucket <= end // SUMMARY_STEPS)
    rows = session.execute(query.order_by(StepSummary.bucket)).all()
    m = len(rows)
    found = {name: np.full((m, len(columns)), MISSING, np.float32) for name in blocks}
    for i, row in enumerate(rows):
        stored = columns < row.n_layers  # a bucket from before the layer table grew
        for name, block in found.items():
            values = _decode(getattr(row, name), np.float32, (row.n_layers,))
            if values is not None:
                block[i, stored] = values[columns[stored]]
    summary = SimpleNamespace(n_steps=sum(row.n_steps for row in rows),
                              bucket_start=np.array([row.bucket * SUMMARY_STEPS
                                                     for row in rows], dtype=np.int64),
                              **found)
    if envelope:
        summary.envelope = _envelope(rows, start, end, n_layers)
    return summary


def _envelope(rows: list, start: int | None, end: int | None, n_layers: int) -> StepSeries:
    """The envelope rows of summary `rows` whose steps lie in [start, end]."""
    if not rows:
        return StepSeries.empty(n_layers)
    envelope = StepSeries(
        np.concatenate([_decode(row.scalars, np.float64, (-1, _K)) for row in rows]),
        np.concatenate([_decode(row.present, np.bool_, (-1, _K)) for row in rows]),
        None, np.zeros(0, np.int64), None, None, None, n_layers)
    return clip_steps(envelope, start, end)


def envelope_clock(row, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """A summary row's envelope steps and the step clock's running sum within the bucket
    at each (the row read with its scalars, present and elapsed columns)."""
    envelope = StepSeries(_decode(row.scalars, np.float64, (-1, _K)),
                          _decode(row.present, np.bool_, (-1, _K)), None,
                          np.zeros(0, np.int64), None, None, None, n_layers)
    return envelope.steps, _decode(row.elapsed, np.float64, (-1,))


def summarised_steps(session: Session, run_id: str, rank: int) -> int:
    """How many of the rank's steps its summaries hold (all of them, unless the run was
    stored before summaries existed)."""
    return int(session.scalar(select(func.coalesce(func.sum(StepSummary.n_steps), 0))
                              .where(StepSummary.run_id == run_id, StepSummary.rank == rank)))
