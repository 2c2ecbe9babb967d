"""Per-rank rollups kept at ingest, so that reads of a run cost the same whatever its
number of ranks and its length: the ranks panel reads one narrow row per rank, the layer
table one rank's statistics, and neither reads a batch.

A rank's rollups are `rank_rollups` rows, one per rollup, so that a batch rewrites only
those it changed:
- the per-layer statistics (float64 per layer): last and largest grad norm, non-finite
  grad and output steps, largest activation abs-max, the dtype computed in, forward time
  sum and count. A batch with per-layer grads rewrites the last grad norm (8 bytes a
  layer); the others when they move (times on sampled steps);
- the step-time window: the rank's last PANEL_STEPS steps and their `t_step_ms`, whose
  median goes to `run_ranks.step_ms_median` for the ranks panel. A batch past the rank's
  last step appends to it (no read); a restart, or a batch that repeats stored steps
  (rare), rebuilds it from the rank's newest batches, as the panel used to read them.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from ampwatch.server.models import RankRollup, RunRank
from ampwatch.server.store.series import FIELD_INDEX, MISSING, StepSeries
from ampwatch.server.store.storage import load_series

PANEL_STEPS = 200  # recent steps the ranks panel takes its median step time over

# the rollups: the per-layer statistics, then the step-time window
(
    GRAD_LAST,
    GRAD_MAX,
    GRAD_NONFINITE,
    ACT_MAX,
    ACT_NONFINITE,
    ACT_DTYPE,
    TIME_SUM,
    TIME_COUNT,
    STEP_MS_WINDOW,
) = range(9)
LAYER_STATS_ROWS = 8
NO_STEP_MS = -1.0  # `step_ms_median` when none of the window's steps had a step time


def fold_rank_rollups(session: Session, rank_row: RunRank, series: StepSeries, *,
                      n_layers: int, rebuild_window: bool) -> None:
    """Fold a just-stored batch (`series`, inside the ingest transaction, its counts
    already added to `rank_row`) into the rank's rollups and `step_ms_median`.
    `rebuild_window`: the batch restarted the rank or repeated stored steps, so the
    step-time window is read again from the rank's batches (one more read); otherwise no
    history is read. One read of the rank's rollups (9 rows); writes the changed ones."""
    rows = _rollup_rows(session, rank_row.run_id, rank_row.rank)
    _write(session, rank_row, rows, _fold_window(session, rank_row, rows, series, n_layers,
                                                 rebuild_window))
    stats = fold_layer_stats(_stats_of(rows), series)
    for stat in range(LAYER_STATS_ROWS):
        _write(session, rank_row, rows, (stat, stats[stat].tobytes()))


# built once: it runs for every batch
_ROLLUPS_BELOW = select(RankRollup).where(
    RankRollup.run_id == bindparam("run_id"), RankRollup.rank == bindparam("rank"),
    RankRollup.rollup < bindparam("below"))


def _rollup_rows(session: Session, run_id: str, rank: int, *,
                 below: int = STEP_MS_WINDOW + 1) -> dict[int, RankRollup]:
    return {row.rollup: row for row in session.scalars(
        _ROLLUPS_BELOW, {"run_id": run_id, "rank": rank, "below": below})}


def _write(session: Session, rank_row: RunRank, rows: dict[int, RankRollup],
           rollup: tuple[int, bytes] | None) -> None:
    """Store one rollup's new bytes, unless unchanged (or None: nothing to store)."""
    if rollup is None:
        return
    key, values = rollup
    row = rows.get(key)
    if row is None:
        session.add(RankRollup(run_id=rank_row.run_id, rank=rank_row.rank, rollup=key,
                               values=values))
    elif bytes(row.values) != values:
        row.values = values


def _fold_window(session: Session, rank_row: RunRank, rows: dict[int, RankRollup],
                 series: StepSeries, n_layers: int, rebuild: bool
                 ) -> tuple[int, bytes] | None:
    """The step-time window with the batch in it (its new bytes, None when unchanged),
    and the rank's `step_ms_median` set from it."""
    old = rows.get(STEP_MS_WINDOW)
    window = None if old is None else _unpack(bytes(old.values))
    if rebuild or (window is None and rank_row.steps > len(series)):
        session.flush()  # the batch and the steps it superseded, as reads see them
        steps, times = _window_from_batches(session, rank_row, n_layers)
    elif len(series):
        steps, times = _appended(window, series)
    else:
        return None
    times_known = times[~np.isnan(times)]
    rank_row.step_ms_median = float(np.median(times_known)) if times_known.size else NO_STEP_MS
    return STEP_MS_WINDOW, _pack(steps, times)


def step_ms_median(session: Session, rank_row: RunRank, n_layers: int) -> float | None:
    """The median `t_step_ms` of the rank's last PANEL_STEPS steps (None without one),
    as ingest keeps it. A rank stored before migration 0013 and silent since has none
    kept: its newest batches are read (one read)."""
    median = rank_row.step_ms_median
    if median is None and rank_row.steps:
        times = _window_from_batches(session, rank_row, n_layers)[1]
        times = times[~np.isnan(times)]
        median = float(np.median(times)) if times.size else None
    return None if median is None or median < 0 else median


def _unpack(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(steps int64, t_step_ms float64, NaN where a step had none) of a packed window."""
    n = len(data) // 16
    return (np.frombuffer(data, dtype=np.int64, count=n),
            np.frombuffer(data, dtype=np.float64, offset=8 * n))


def _pack(steps: np.ndarray, times: np.ndarray) -> bytes:
    return steps.astype(np.int64).tobytes() + times.astype(np.float64).tobytes()


def _appended(window: tuple[np.ndarray, np.ndarray] | None, series: StepSeries
              ) -> tuple[np.ndarray, np.ndarray]:
    """The window with the batch's steps after it, cut to the last PANEL_STEPS steps; a
    step sent twice keeps its last copy (as `series.concat` does)."""
    steps, times = series.steps, series.column("t_step_ms")
    if window is not None:
        steps, times = np.concatenate([window[0], steps]), np.concatenate([window[1], times])
    order = np.argsort(steps, kind="stable")
    steps, times = steps[order], times[order]
    last_copy = np.append(steps[1:] != steps[:-1], True)
    return steps[last_copy][-PANEL_STEPS:], times[last_copy][-PANEL_STEPS:]


def _window_from_batches(session: Session, rank_row: RunRank, n_layers: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The rank's last PANEL_STEPS steps and their step times, from its newest batches.
    Batches a restart cut short hold fewer steps than they count: then a wider read, up
    to three more times."""
    wanted = min(PANEL_STEPS, rank_row.steps)
    for batch_steps in PANEL_STEPS * 4 ** np.arange(4):
        recent = load_series(session, rank_row.run_id, rank_row.rank,
                             last_n=int(batch_steps), n_layers=n_layers, with_layers=False,
                             with_acts=False)
        if len(recent) >= wanted:
            break
    recent = recent.take(np.arange(max(0, len(recent) - PANEL_STEPS), len(recent)))
    return recent.steps, recent.column("t_step_ms")


def _stats_of(rows: dict[int, RankRollup]) -> np.ndarray | None:
    if any(stat not in rows for stat in range(LAYER_STATS_ROWS)):
        return None
    return np.stack([np.frombuffer(rows[stat].values, dtype=np.float64)
                     for stat in range(LAYER_STATS_ROWS)])


def fold_layer_stats(old: np.ndarray | None, series: StepSeries) -> np.ndarray:
    """`old` (LAYER_STATS_ROWS, width) with one batch folded in, at the batch's width (a
    layer table that grew starts its new layers empty; one that shrank drops the rest)."""
    n_layers = series.n_layers
    stats = np.zeros((LAYER_STATS_ROWS, n_layers))
    stats[[GRAD_LAST, GRAD_MAX, ACT_MAX]] = -1.0
    if old is not None:
        width = min(old.shape[1], n_layers)
        stats[:, :width] = old[:, :width]
    if series.layer_grad is not None:
        _fold(stats, series.layer_grad, GRAD_MAX, GRAD_NONFINITE, GRAD_LAST)
    if series.act_absmax is not None:
        _fold(stats, series.act_absmax, ACT_MAX, ACT_NONFINITE)
        dtypes = series.act_dtype
        stats[ACT_DTYPE] = _last_present(dtypes, dtypes != 0, stats[ACT_DTYPE])
        times = series.act_time
        timed = times != MISSING
        stats[TIME_SUM] += np.where(timed, times, 0).sum(axis=0)
        stats[TIME_COUNT] += timed.sum(axis=0)
    _count_unsampled_first(stats[ACT_NONFINITE], series)
    return stats


def _fold(stats: np.ndarray, block: np.ndarray, max_row: int, nonfinite_row: int,
          last_row: int | None = None) -> None:
    finite = np.isfinite(block)
    present = block != MISSING
    stats[nonfinite_row] += (~finite).sum(axis=0)
    stats[max_row] = np.maximum(stats[max_row], np.where(finite, block, -1.0).max(axis=0))
    if last_row is not None:
        stats[last_row] = _last_present(block, present, stats[last_row])


def _count_unsampled_first(counts: np.ndarray, series: StepSeries) -> None:
    """Add to each layer's non-finite output steps the steps that sampled no activations
    but whose every-step forward check named that layer first: its output held inf/NaN
    there too, and without them the column reads one less than the grad column on the
    step an overflow begins (sampling turns on only after that step)."""
    column = FIELD_INDEX["first_nonfinite_layer"]
    named = series.present[:, column] & _flagged(series, "forward_nonfinite")
    if series.act_absmax is not None:
        sampled = series.act_step[(series.act_absmax != MISSING).any(axis=1)]
        named &= ~np.isin(series.steps, sampled)
    first = series.scalars[named, column].astype(np.int64)
    first = first[(first >= 0) & (first < counts.size)]
    counts += np.bincount(first, minlength=counts.size)


def _flagged(series: StepSeries, name: str) -> np.ndarray:
    i = FIELD_INDEX[name]
    return series.present[:, i] & (series.scalars[:, i] != 0)


def _last_present(block: np.ndarray, present: np.ndarray, default: np.ndarray) -> np.ndarray:
    """Per column, the last value where `present`, else `default`."""
    last_index = block.shape[0] - 1 - present[::-1].argmax(axis=0)
    last = block[last_index, np.arange(block.shape[1])]
    return np.where(present.any(axis=0), last, default)


def load_layer_stats(session: Session, run_id: str, rank: int, n_layers: int
                     ) -> np.ndarray | None:
    """The rank's per-layer statistics (LAYER_STATS_ROWS, n_layers), None before its
    first batch. One read of 8 rows."""
    stats = _stats_of(_rollup_rows(session, run_id, rank, below=LAYER_STATS_ROWS))
    if stats is None or stats.shape[1] == n_layers:
        return stats
    if stats.shape[1] > n_layers:
        return stats[:, :n_layers]
    return np.pad(stats, ((0, 0), (0, n_layers - stats.shape[1])))
