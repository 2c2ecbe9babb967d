"""Combined grad norms of sharded runs, kept by the analysis worker: per step, the sum of
the ranks' squared total grad norms, in buckets of BUCKET_STEPS step numbers, so that a
read of a run's combined norms (server/services/ranks.py) reads a few bucket rows instead of every
rank's batches.

A sum of squares cannot take a value out again exactly (inf - inf is NaN), so a rank is
folded in only while it appends: each judged batch whose steps all follow the rank's
last step, starting from its first batch. Each rank's `combined_ranks` row says through
which step that holds. A restart, a late or overlapping batch, or steps stored before
the rank was folded (analysis off, the run not yet sharded, a database from before this
table) stop the rank there for good (`stuck`). A read takes the buckets through the
lowest rank's `through`, and every rank's batches beyond it, so it gives the same
answer as reading every rank's batches, at the cost of the steps the worker has not
folded: none once it has caught up, unless a rank is stuck.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server.models import CombinedNorms, CombinedRank, RunRank
from ampwatch.server.store.restarts import restart_from
from ampwatch.server.store.series import StepSeries

BUCKET_STEPS = 1000


class Fold(NamedTuple):
    """One judged batch of a rank, and the rank's last step before it as ingest saw it."""

    rank: int
    batch: StepSeries
    rank_last_step: int | None


def fold(session: Session, run_id: str, folds: list[Fold]) -> None:
    """Fold a claim's judged batches of a sharded run, in order, in the worker's
    transaction: a batch is added to the buckets when it appends to what was folded of
    its rank, else the rank stops there. One read of the claim's ranks and one of its
    buckets, and each changed row written once."""
    ranks = {f.rank for f in folds}
    held = {row.rank: row for row in session.scalars(select(CombinedRank).where(
        CombinedRank.run_id == run_id, CombinedRank.rank.in_(ranks)))} if ranks else {}
    added: list[StepSeries] = []
    for rank, batch, rank_last_step in folds:
        row = held.get(rank)
        restart = restart_from(batch.events)
        if not len(batch) and restart is None:
            continue  # events only: nothing to add, nothing replaced
        folded_so_far = (row is None and rank_last_step is None) or (
            row is not None and not row.stuck and row.through == rank_last_step)
        appends = restart is None and (
            rank_last_step is None or int(batch.steps[0]) > rank_last_step)
        if folded_so_far and appends:
            added.append(batch)
            last = int(batch.steps[-1])
            if row is None:
                held[rank] = CombinedRank(run_id=run_id, rank=rank, through=last, stuck=False)
                session.add(held[rank])
            else:
                row.through = last
        elif row is not None:
            # what was folded stays exact up to the first step the batch replaced or missed
            first = restart["step"] if restart is not None else int(batch.steps[0])
            row.through = min(row.through, first - 1)
            row.stuck = True
    if added:
        _add(session, run_id, added)


def _add(session: Session, run_id: str, batches: list[StepSeries]) -> None:
    """Add the batches' ranks, squares and missing totals to their buckets."""
    steps = np.concatenate([b.steps for b in batches])
    has = np.concatenate([b.has("grad_norm") for b in batches])
    values = np.concatenate([b.column("grad_norm") for b in batches])
    squares = np.square(np.where(has, values, 0.0))
    buckets = steps // BUCKET_STEPS
    touched = np.unique(buckets).tolist()
    rows = {row.bucket: row for row in session.scalars(select(CombinedNorms).where(
        CombinedNorms.run_id == run_id, CombinedNorms.bucket.in_(touched)))}
    for bucket in touched:
        row = rows.get(bucket)
        if row is None:
            row = CombinedNorms(run_id=run_id, bucket=bucket, **_encode(*_empty()))
            session.add(row)
        ranks, sum_sq, unknown = _decode(row)
        part = buckets == bucket
        offsets = steps[part] - bucket * BUCKET_STEPS
        # np.add.at: a step of several ranks in one claim is added once for each
        np.add.at(ranks, offsets, 1)
        np.add.at(sum_sq, offsets, squares[part])
        np.add.at(unknown, offsets, (~has[part]).astype(np.int32))
        for name, value in _encode(ranks, sum_sq, unknown).items():
            setattr(row, name, value)


def folded_through(session: Session, run_id: str, reporting: int) -> int | None:
    """The step through which every one of the run's `reporting` ranks is folded (the
    lowest rank's `through`); None when a rank has no row (never folded). Two reads of
    the `(run_id, through)` index."""
    lowest, held = session.execute(
        select(func.min(CombinedRank.through), func.count())
        .where(CombinedRank.run_id == run_id)).one()
    return lowest if held == reporting and held else None


def lowest_last_step(session: Session, run_id: str) -> int | None:
    """The lowest last step over the run's ranks (one probe of `(run_id, last_step)`)."""
    return session.scalar(select(func.min(RunRank.last_step))
                          .where(RunRank.run_id == run_id))


def add_folded(session: Session, run_id: str, sums, start: int, end: int) -> None:
    """Add the buckets' sums over [start, end] to `sums` (a ranks.ShardSums of a span
    that holds [start, end]): one read of at most (end - start) / BUCKET_STEPS + 2 rows."""
    rows = session.scalars(select(CombinedNorms).where(
        CombinedNorms.run_id == run_id,
        CombinedNorms.bucket >= start // BUCKET_STEPS,
        CombinedNorms.bucket <= end // BUCKET_STEPS))
    for row in rows:
        first = row.bucket * BUCKET_STEPS
        low, high = max(start, first), min(end, first + BUCKET_STEPS - 1)
        ranks, sum_sq, unknown = _decode(row)
        part = slice(low - first, high - first + 1)
        sums.add_folded(low, ranks[part], sum_sq[part], unknown[part])


def _empty() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.zeros(BUCKET_STEPS, np.int32), np.zeros(BUCKET_STEPS),
            np.zeros(BUCKET_STEPS, np.int32))


def _decode(row: CombinedNorms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.frombuffer(row.ranks, np.int32).copy(),
            np.frombuffer(row.sum_sq, np.float64).copy(),
            np.frombuffer(row.unknown, np.int32).copy())


def _encode(ranks: np.ndarray, sum_sq: np.ndarray, unknown: np.ndarray) -> dict[str, bytes]:
    return {"ranks": ranks.tobytes(), "sum_sq": sum_sq.tobytes(),
            "unknown": unknown.tobytes()}
