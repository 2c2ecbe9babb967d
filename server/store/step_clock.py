"""The step clock: a rank's time at each of its steps, for the charts' time axes
(`?x=relative`, `?x=wall`). A step's time is the running sum of `t_step_ms` from the end
of the rank's first stored step to the end of this step, over every stored step in
between; a step without a finite `t_step_ms`, and a step never stored, adds nothing.

The sum is kept at ingest in the step summaries (summaries.fold_batch): each bucket's sum,
its first step's time, and each envelope row's running sum within the bucket. So a read
costs the summaries' narrow columns up to its last step, the envelopes of the buckets it
draws in, and the steps of only those buckets whose rows are not envelope rows (a zoom at
full resolution): not the rank's whole history.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.models import StepSummary
from ampwatch.server.store.storage import load_series
from ampwatch.server.store.summaries import (
    SUMMARY_STEPS,
    envelope_clock,
    step_ms,
    summarised_steps,
)


def step_clock(session: Session, run_id: str, rank: int, steps: np.ndarray, *,
               n_layers: int, stored_steps: int) -> np.ndarray:
    """The clock (ms) at each of `steps` (int64, any order), NaN where the step is not
    stored (lost, superseded, archived). A rank whose summaries do not hold all of its
    `stored_steps` (stored before summaries existed) has every step read up to the last."""
    if not len(steps):
        return np.zeros(0)
    last_bucket = int(steps.max()) // SUMMARY_STEPS
    mine = (StepSummary.run_id == run_id, StepSummary.rank == rank)
    buckets = session.execute(
        select(StepSummary.bucket, StepSummary.n_steps, StepSummary.step_ms_sum,
               StepSummary.first_step_ms).where(*mine, StepSummary.bucket <= last_bucket)
        .order_by(StepSummary.bucket)).all()
    if not buckets or summarised_steps(session, run_id, rank) < stored_steps:
        return _from_steps(session, run_id, rank, steps, n_layers)
    index = {row.bucket: i for i, row in enumerate(buckets)}
    sums = np.array([np.nan if row.step_ms_sum is None else row.step_ms_sum
                     for row in buckets])
    first_ms = buckets[0].first_step_ms
    within = np.full(len(steps), np.nan)  # each step's running sum inside its bucket
    drawn = sorted({index[b] for b in (steps // SUMMARY_STEPS).tolist() if b in index})
    for row in session.execute(
            select(StepSummary.bucket, StepSummary.scalars, StepSummary.present,
                   StepSummary.elapsed).where(
                *mine, StepSummary.bucket.in_([buckets[i].bucket for i in drawn]))):
        if row.elapsed is not None:
            _fill(within, steps, *envelope_clock(row, n_layers))
    # buckets to read from their steps: those without a clock, and those drawn at rows
    # the envelope does not keep
    unread = np.isnan(sums)
    unread[[index[b] for b in (steps[np.isnan(within)] // SUMMARY_STEPS).tolist()
            if b in index]] = True
    for first, last in _runs(np.flatnonzero(unread)):
        series = load_series(session, run_id, rank, buckets[first].bucket * SUMMARY_STEPS,
                             (buckets[last].bucket + 1) * SUMMARY_STEPS - 1,
                             n_layers=n_layers, with_layers=False, with_acts=False)
        times, at = step_ms(series), series.steps // SUMMARY_STEPS
        for i in range(first, last + 1):
            bucket = at == buckets[i].bucket
            running = np.cumsum(times[bucket])
            sums[i] = running[-1] if running.size else 0.0
            _fill(within, steps, series.steps[bucket], running)
            if i == 0:
                first_ms = float(times[0]) if times.size else 0.0
    before = np.concatenate([[0.0], np.cumsum(sums)[:-1]])  # the buckets ahead of each
    at = np.array([index.get(b, -1) for b in (steps // SUMMARY_STEPS).tolist()])
    clock = np.where(at >= 0, before[at] + within - (first_ms or 0.0), np.nan)
    return np.where(np.isnan(within), np.nan, clock)


def _from_steps(session: Session, run_id: str, rank: int, steps: np.ndarray,
                n_layers: int) -> np.ndarray:
    series = load_series(session, run_id, rank, None, int(steps.max()), n_layers=n_layers,
                         with_layers=False, with_acts=False)
    times = step_ms(series)
    times[:1] = 0.0  # the first step's time was spent before the clock's zero
    clock = np.full(len(steps), np.nan)
    _fill(clock, steps, series.steps, np.cumsum(times))
    return clock


def _fill(out: np.ndarray, steps: np.ndarray, known: np.ndarray, values: np.ndarray) -> None:
    """out[i] = values[j] where steps[i] == known[j] (`known` sorted)."""
    if not known.size:
        return
    at = np.clip(np.searchsorted(known, steps), 0, known.size - 1)
    found = known[at] == steps
    out[found] = values[at[found]]


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive runs of `indices` as (first, last) pairs."""
    if not indices.size:
        return []
    breaks = np.flatnonzero(np.diff(indices) > 1)
    return list(zip(indices[np.r_[0, breaks + 1]].tolist(),
                    indices[np.r_[breaks, indices.size - 1]].tolist(), strict=True))
