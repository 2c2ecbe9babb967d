"""Per-rank rollups kept at ingest, so that reads of a run cost the same whatever its
number of ranks and its length: the ranks panel reads one narrow row per rank, the layer
table one rank's statistics, and neither reads a batch.

- The step-time window (`run_ranks.step_ms_window`): the rank's last PANEL_STEPS steps
  and their `t_step_ms`, for the ranks panel's median step time. A batch past the rank's
  last step appends to it (no read); a restart or a batch that repeats stored steps (rare)
  rebuilds it from the rank's newest batches, as the panel used to read them.
- The per-layer statistics (`rank_layer_stats`, one row per statistic, float64 per
  layer): last and largest grad norm, non-finite grad and output steps, largest
  activation abs-max, the dtype computed in, forward time sum and count. A batch
  rewrites only the statistics it changed: the last grad norm (8 bytes a layer) on a
  batch with per-layer grads, the others when they move (times on sampled steps).
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.models import RankLayerStat, RunRank
from ampwatch.server.series import FIELD_INDEX, MISSING, StepSeries
from ampwatch.server.storage import load_series

PANEL_STEPS = 200  # recent steps the ranks panel takes its median step time over

# the statistics, one `rank_layer_stats` row each
(
    GRAD_LAST,
    GRAD_MAX,
    GRAD_NONFINITE,
    ACT_MAX,
    ACT_NONFINITE,
    ACT_DTYPE,
    TIME_SUM,
    TIME_COUNT,
) = range(8)
LAYER_STATS_ROWS = 8


def fold_rank_rollups(session: Session, rank_row: RunRank, series: StepSeries, *,
                      n_layers: int, rebuild_window: bool) -> None:
    """Fold a just-stored batch (`series`, inside the ingest transaction) into its rank's
    rollups. `rebuild_window`: the batch restarted the rank or repeated stored steps, so
    its step-time window is read again from the rank's batches (one read); otherwise no
    history is read. Reads the rank's statistics (8 rows) and writes the changed ones."""
    window = _window(rank_row.step_ms_window)
    if rebuild_window or (window is None and rank_row.steps > len(series)):
        session.flush()  # the batch and its superseded steps, as reads will see them
        rank_row.step_ms_window = _pack(*_window_from_batches(
            session, rank_row.run_id, rank_row.rank, n_layers))
    elif len(series):
        rank_row.step_ms_window = _pack(*_appended(window, series))
    _fold_layer_stats(session, rank_row.run_id, rank_row.rank, series)


def step_ms_median(session: Session, rank_row: RunRank, n_layers: int) -> float | None:
    """The median `t_step_ms` of the rank's last PANEL_STEPS steps (None without one).
    Reads nothing but the row, except for a rank whose window predates it (stored before
    migration 0013 and silent since): its newest batches, once per call."""
    window = _window(rank_row.step_ms_window)
    if window is None:
        window = _window_from_batches(session, rank_row.run_id, rank_row.rank, n_layers)
    times = window[1][~np.isnan(window[1])]
    return float(np.median(times)) if times.size else None


def _window(data: bytes | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps int64, t_step_ms float64, NaN where a step had none) of a packed window."""
    if data is None:
        return None
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


def _window_from_batches(session: Session, run_id: str, rank: int, n_layers: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    recent = load_series(session, run_id, rank, last_n=PANEL_STEPS, n_layers=n_layers,
                         with_layers=False, with_acts=False)
    return recent.steps, recent.column("t_step_ms")


def _fold_layer_stats(session: Session, run_id: str, rank: int, series: StepSeries) -> None:
    """Fold one batch into the rank's per-layer statistics; write the rows that changed."""
    rows = {row.stat: row for row in session.scalars(select(RankLayerStat).where(
        RankLayerStat.run_id == run_id, RankLayerStat.rank == rank))}
    old = _stats_of(rows)
    stats = fold_layer_stats(old, series)
    for stat in range(LAYER_STATS_ROWS):
        values = stats[stat].tobytes()
        row = rows.get(stat)
        if row is None:
            session.add(RankLayerStat(run_id=run_id, rank=rank, stat=stat, values=values))
        elif bytes(row.values) != values:
            row.values = values


def _stats_of(rows: dict[int, RankLayerStat]) -> np.ndarray | None:
    if len(rows) < LAYER_STATS_ROWS:
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
    """The rank's statistics (LAYER_STATS_ROWS, n_layers), None before its first batch.
    One read of 8 rows."""
    rows = {row.stat: row for row in session.scalars(select(RankLayerStat).where(
        RankLayerStat.run_id == run_id, RankLayerStat.rank == rank))}
    stats = _stats_of(rows)
    if stats is None or stats.shape[1] == n_layers:
        return stats
    if stats.shape[1] > n_layers:
        return stats[:, :n_layers]
    return np.pad(stats, ((0, 0), (0, n_layers - stats.shape[1])))
