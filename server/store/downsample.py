"""Server-side downsampling that never hides a problem.

Steps: equal-width buckets keep, per bucket, the steps where each watched series is
at its minimum and maximum, never more than the budget; every skipped or non-finite
step is returned apart from them (`events`). Matrices (layers x steps): each bucket
keeps its largest finite value, or the non-finite value when the bucket had one. Both
are O(n) numpy passes.
"""

from __future__ import annotations

import math

import numpy as np

from ampwatch.server.store.series import MISSING, StepSeries


def _buckets(n: int, n_buckets: int) -> tuple[int, int]:
    """(bucket width, bucket count) covering n items with at most n_buckets buckets."""
    width = max(1, math.ceil(n / max(1, n_buckets)))
    return width, math.ceil(n / width)


def _padded(values: np.ndarray, width: int, count: int, fill: float) -> np.ndarray:
    pad = width * count - len(values)
    return np.concatenate([values, np.full(pad, fill)]).reshape(count, width)


def keep_extremes(columns: list[np.ndarray], max_points: int) -> np.ndarray:
    """Sorted positions of at most `max_points` of n points: per equal-width bucket its
    first point and the points where each column is at its minimum and maximum.

    columns: series whose per-bucket min and max must survive (NaN = missing or
    non-finite: never an extreme; callers return skipped and non-finite points apart,
    as `events`).
    """
    n = len(columns[0]) if columns else 0
    if n <= max_points:
        return np.arange(n)
    per_bucket = 1 + 2 * len(columns)
    width, count = _buckets(n, max(1, max_points // per_bucket))
    starts = np.arange(count) * width
    keep = [starts]
    for col in columns:
        finite = np.isfinite(col)
        if not finite.any():
            continue
        hi = _padded(np.where(finite, col, -np.inf), width, count, -np.inf)
        lo = _padded(np.where(finite, col, np.inf), width, count, np.inf)
        has = np.isfinite(hi).any(axis=1)
        keep.append((starts + hi.argmax(axis=1))[has])
        keep.append((starts + lo.argmin(axis=1))[has])
    index = np.unique(np.concatenate(keep))
    index = index[index < n]
    if len(index) > max_points:  # fewer than one bucket's worth asked: thin evenly
        index = index[np.linspace(0, len(index) - 1, max_points).round().astype(np.int64)]
    return index


def bucket_matrix(
    steps: np.ndarray, values: np.ndarray, n_buckets: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reduce an (n_steps, n_layers) matrix to at most n_buckets columns.

    Returns (step_start, step_end, reduced (n_layers, buckets), empty mask).
    A cell is the bucket's largest finite value; NaN when the bucket had a NaN, else
    +inf when it had an infinity; empty when every value was MISSING.
    """
    n, n_layers = values.shape
    if n == 0:
        return (np.zeros(0, np.int64), np.zeros(0, np.int64),
                np.zeros((n_layers, 0), values.dtype), np.zeros((n_layers, 0), bool))
    width, count = _buckets(n, n_buckets)
    pad = width * count - n
    if pad:
        values = np.concatenate([values, np.full((pad, n_layers), MISSING, values.dtype)])
    # max propagates NaN, and +inf beats every finite value: one pass gives exactly
    # "NaN, else inf, else the largest value"; MISSING (-1) loses to any real value
    best = values.reshape(count, width, n_layers).max(axis=1)
    empty = best == float(MISSING)
    starts = np.arange(count) * width
    ends = np.minimum(starts + width, n) - 1
    return steps[starts], steps[ends], np.ascontiguousarray(best.T), empty.T


def always_kept(series: StepSeries) -> np.ndarray:
    """Steps that downsampling must never drop: skipped or non-finite."""
    keep = series.skipped.copy()
    for name in ("grad_norm", "loss", "loss_scale"):
        col = series.column(name)
        keep |= series.has(name) & ~np.isfinite(col)
    keep |= series.column("input_nonfinite") == 1
    keep |= series.column("forward_nonfinite") == 1
    return keep
