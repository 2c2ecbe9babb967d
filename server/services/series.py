"""Read queries behind the API and the pages (every page's JSON twin calls these).

Each returns a plain dict shaped like its schema in server/schemas.py, with
non-finite floats already in wire form, so a 2,000-point answer is built with a few
numpy passes and one `json.dumps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
from sqlalchemy.orm import Session

from ampwatch.server.errors import InvalidInput, NotFound
from ampwatch.server.models import Run, RunRank
from ampwatch.server.responses import FloatRows
from ampwatch.server.services.runs import run_ranks
from ampwatch.server.store.downsample import always_kept, bucket_matrix, keep_extremes
from ampwatch.server.store.rollups import (
    ACT_DTYPE,
    ACT_MAX,
    ACT_NONFINITE,
    GRAD_LAST,
    GRAD_MAX,
    GRAD_NONFINITE,
    TIME_COUNT,
    TIME_SUM,
    load_layer_stats,
)
from ampwatch.server.store.series import (
    BOOL_FIELDS,
    DTYPES,
    INT_FIELDS,
    MISSING,
    SCALAR_FIELDS,
    StepSeries,
    guard_reason,
)
from ampwatch.server.store.spike_samples import SIGNALS, spike_matrix
from ampwatch.server.store.step_clock import step_clock
from ampwatch.server.store.storage import layer_rows, load_layers, load_ranks_series, load_series
from ampwatch.server.store.summaries import SUMMARY_STEPS, load_summaries, summarised_steps
from ampwatch.wire import encode_float, encode_float_array

MATRIX_METRICS = ("grad_norm", "act_absmax", "act_time_ms", *SIGNALS)
# a downsampled read spanning more steps than this comes from the step summaries
LONG_RANGE_STEPS = 20 * SUMMARY_STEPS


def _summarised(session: Session, run: Run, rank: int, start: int | None,
                end: int | None, layers: np.ndarray | None = None,
                rank_row: RunRank | None = None, **parts) -> SimpleNamespace | None:
    """The rank's step summaries over [start, end] when a zoomed-out read should use them
    (an archived run, or a range longer than LONG_RANGE_STEPS whose every step is
    summarised); None to read the steps themselves. `parts`: what `load_summaries`
    reads (all of it by default). `rank_row`: the rank's row when already read."""
    if rank_row is None:
        rank_row = session.get(RunRank, (run.id, rank))
    if rank_row is None or rank_row.last_step is None:
        return None
    if run.archived_at is None:
        first = start if start is not None else rank_row.last_step - rank_row.steps + 1
        last = min(end, rank_row.last_step) if end is not None else rank_row.last_step
        if last - first < LONG_RANGE_STEPS or summarised_steps(
                session, run.id, rank) < rank_row.steps:
            return None
    return load_summaries(session, run.id, rank, start, end, run.n_layers, layers, **parts)


def _step_rows(series: StepSeries, rank: int) -> list[dict]:
    """One dict per step, in wire form."""
    columns = {}
    for j, name in enumerate(SCALAR_FIELDS):
        values, present = series.scalars[:, j], series.present[:, j]
        if name in BOOL_FIELDS:
            col = [bool(v) if p else None for v, p in zip(values.tolist(), present.tolist(),
                                                          strict=True)]
        elif name == "autocast_dtype":
            col = [DTYPES[int(v)] or None if p else None
                   for v, p in zip(values.tolist(), present.tolist(), strict=True)]
        elif name == "guarded":
            col = [guard_reason(v) if p else None
                   for v, p in zip(values.tolist(), present.tolist(), strict=True)]
        elif name in INT_FIELDS:
            col = [int(v) if p else None for v, p in zip(values.tolist(), present.tolist(),
                                                         strict=True)]
        else:
            col = encode_float_array(values, missing=~present)
        columns[name] = col
    names = list(columns)
    return [
        {"rank": rank, **dict(zip(names, row, strict=True))}
        for row in zip(*columns.values(), strict=True)
    ]


def steps_query(
    session: Session,
    run: Run,
    *,
    rank: int | None = None,
    start: int | None = None,
    end: int | None = None,
    max_points: int | None = None,
    limit: int = 10_000,
    ranks: Sequence[int] | None = None,
    rank_rows: list[RunRank] | None = None,
) -> dict:
    """Step records in [start, end] of `rank`, else of `ranks`, else of every rank. With
    max_points: at most that many `items`, chosen per rank so that the extremes of
    loss_scale, grad_norm and loss survive, and every skipped or non-finite step of the
    range in `events`. Without: the first `limit` steps, with `next_start` for the rest,
    and no `events`. The ranks' batches are one read; a long range's summaries, one
    read per rank. `rank_rows`: the run's rank rows, when already read."""
    every = rank is None and ranks is None
    if rank is None and rank_rows is None:
        rank_rows = run_ranks(session, run.id)
    rows = {} if rank is not None else {r.rank: r for r in rank_rows}
    ranks = [rank] if rank is not None else list(rows) if ranks is None else list(ranks)
    items: list[dict] = []
    events: list[dict] = []
    total = 0
    downsampled = False
    next_start = None
    budget = max(1, (max_points or 0) // max(1, len(ranks)))
    summaries = {r: _summarised(session, run, r, start, end, blocks=(), rank_row=rows.get(r))
                 for r in ranks} if max_points is not None else {}
    unsummarised = [r for r in ranks if summaries.get(r) is None]
    every = every and len(unsummarised) == len(ranks)  # then no list of ranks to send
    stored = load_ranks_series(session, run.id, None if every else unsummarised, start, end,
                               n_layers=run.n_layers, with_layers=False, with_acts=False
                               ) if unsummarised else {}
    for r in ranks:
        summary = summaries.get(r)
        if summary is not None:  # the envelope rows: every extreme and anomaly of the range
            series = summary.envelope
            total += summary.n_steps
            downsampled = True
        else:
            series = stored[r] if r in stored else StepSeries.empty(run.n_layers)
            total += len(series)
        if max_points is not None:
            events.extend(_step_rows(series.take(np.flatnonzero(always_kept(series))), r))
            if len(series) > budget:
                downsampled = True
                columns = [series.column(n) for n in ("loss_scale", "grad_norm", "loss")]
                series = series.take(keep_extremes(columns, budget))
        elif len(series) > limit:
            cut = series.steps[limit]
            next_start = int(cut) if next_start is None else min(next_start, int(cut))
            series = series.take(np.arange(limit))
        items.extend(_step_rows(series, r))
    if next_start is not None:  # ranks cut at different steps: the page ends at the first cut
        items = [row for row in items if row["step"] < next_start]
    items.sort(key=lambda row: (row["step"], row["rank"]))
    if max_points is not None and len(items) > max_points:  # more ranks than points
        items = [items[i] for i in np.linspace(0, len(items) - 1, max_points).round()
                 .astype(np.int64).tolist()]
    events.sort(key=lambda row: (row["step"], row["rank"]))
    return {
        "run_id": run.id,
        "total": total,
        "count": len(items),
        "downsampled": downsampled,
        "next_start": next_start,
        "items": items,
        "events": events,
    }


def with_events(steps: dict) -> list[dict]:
    """A `steps_query` answer's items and events as one list in (step, rank) order, each
    step once: what a chart draws (lines through the extremes, every skip marked)."""
    rows = {(row["step"], row["rank"]): row for row in steps["items"]}
    rows.update({(row["step"], row["rank"]): row for row in steps.get("events", ())})
    return [rows[key] for key in sorted(rows)]


def with_elapsed(session: Session, run: Run, steps: dict) -> dict:
    """A `steps_query` answer with `elapsed_ms` on each item and event: the time from the
    end of its rank's first stored step to the end of this step, the running sum of
    `t_step_ms` over every stored step in between (not only the points the answer kept;
    store/step_clock.py). A step without `t_step_ms`, and a step never stored (lost, or
    not yet sent), adds nothing, so the sum runs short by their time. Null where the step
    itself is not stored. Reads the step summaries up to the answer's last step, not every
    step (a rank stored before summaries existed: its steps from the first)."""
    rows = [*steps["items"], *steps.get("events", ())]
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    for rank, mine in by_rank.items():
        wanted = np.array([row["step"] for row in mine], dtype=np.int64)
        rank_row = session.get(RunRank, (run.id, rank))
        clock = step_clock(session, run.id, rank, wanted, n_layers=run.n_layers,
                           stored_steps=rank_row.steps if rank_row else 0)
        for row, elapsed in zip(mine, clock.tolist(), strict=True):
            row["elapsed_ms"] = None if math.isnan(elapsed) else elapsed
    return steps


def _float_or_none(x: float) -> float | str | None:
    """A running-summary value; negative (the "none yet" marker) becomes None."""
    return None if np.isfinite(x) and x < 0 else encode_float(float(x))


def layers_query(session: Session, run: Run, *, rank: int = 0,
                 layers: Sequence[int] | None = None) -> dict:
    """The layer table with per-layer summaries kept up to date at ingest; with `layers`
    (indices), only those layers, in that order."""
    stats = load_layer_stats(session, run.id, rank, run.n_layers)
    items = []
    for layer in load_layers(session, run.id, layers):
        i = layer.index
        if stats is None:
            summary = {"grad_norm_last": None, "grad_norm_max": None, "grad_nonfinite_steps": 0,
                       "act_absmax_max": None, "act_nonfinite_steps": 0, "act_dtype": None,
                       "fwd_time_mean_ms": None}
        else:
            count = stats[TIME_COUNT, i]
            summary = {
                "grad_norm_last": _float_or_none(stats[GRAD_LAST, i]),
                "grad_norm_max": _float_or_none(stats[GRAD_MAX, i]),
                "grad_nonfinite_steps": int(stats[GRAD_NONFINITE, i]),
                "act_absmax_max": _float_or_none(stats[ACT_MAX, i]),
                "act_nonfinite_steps": int(stats[ACT_NONFINITE, i]),
                "act_dtype": DTYPES[int(stats[ACT_DTYPE, i])] or None,
                "fwd_time_mean_ms": float(stats[TIME_SUM, i] / count) if count else None,
            }
        items.append({
            "index": i, "name": layer.name, "type": layer.type,
            "param_count": layer.param_count, "dtype": layer.dtype, "shapes": layer.shapes,
            "attrs": layer.attrs, "forward_index": layer.forward_index, "summary": summary,
        })
    return {"run_id": run.id, "rank": rank, "items": items}


def _points(steps: np.ndarray, values: np.ndarray, max_points: int | None,
            extra: dict[str, list] | None = None) -> tuple[list[dict], bool, list[dict]]:
    """(at most `max_points` points keeping the extremes, whether some were left out,
    the non-finite points: every one of them, when max_points is given)."""
    index = np.arange(len(steps))
    events = np.zeros(0, np.int64)
    if max_points is not None:
        events = np.flatnonzero(~np.isfinite(values))
        if len(steps) > max_points:
            col = np.where(values == MISSING, np.nan, values.astype(np.float64))
            index = keep_extremes([col], max_points)

    def points_at(at: np.ndarray) -> list[dict]:
        encoded = encode_float_array(values[at], missing=values[at] == MISSING)
        points = [{"step": int(s), "value": v}
                  for s, v in zip(steps[at].tolist(), encoded, strict=True)]
        for name, col in (extra or {}).items():
            for p, i in zip(points, at.tolist(), strict=True):
                p[name] = col[i]
        return points

    return points_at(index), len(index) < len(steps), points_at(events)


def layer_series_query(
    session: Session,
    run: Run,
    index: int,
    *,
    rank: int = 0,
    start: int | None = None,
    end: int | None = None,
    max_points: int | None = None,
) -> dict:
    """One layer's grad norm per step and its sampled activation stats."""
    if not 0 <= index < run.n_layers:
        raise NotFound(f"run {run.id!r} has no layer {index} (it has {run.n_layers})")
    layer = load_layers(session, run.id, [index])[0]
    summary = (_summarised(session, run, rank, start, end, envelope=False)
               if max_points is not None else None)
    if summary is not None:
        return _layer_envelope(run, rank, index, layer.name, summary, max_points)
    series = load_series(session, run.id, rank, start, end, n_layers=run.n_layers,
                         layers=np.array([index]))
    grad_values = (series.layer_grad[:, 0] if series.layer_grad is not None
                   else np.full(len(series), MISSING, np.float32))
    grad, grad_cut, grad_events = _points(series.steps, grad_values, max_points)
    for p in grad + grad_events:
        p["grad_norm"] = p.pop("value")
    acts: list[dict] = []
    act_events: list[dict] = []
    act_cut = False
    if series.act_absmax is not None:
        dtype_names = [DTYPES[c] or None for c in series.act_dtype[:, 0].tolist()]
        times = encode_float_array(series.act_time[:, 0], missing=series.act_time[:, 0] == MISSING)
        extra = {"act_dtype": dtype_names, "act_time_ms": times}
        if series.act_grad_zero is not None:
            zeros = series.act_grad_zero[:, 0]
            extra["grad_zero_share"] = encode_float_array(zeros, missing=zeros == MISSING)
        acts, act_cut, act_events = _points(series.act_step, series.act_absmax[:, 0],
                                            max_points, extra)
        for p in acts + act_events:
            p["act_absmax"] = p.pop("value")
            p["grad_norm"] = None
    return {
        "run_id": run.id, "rank": rank, "layer": index, "name": layer.name,
        "total": len(series), "downsampled": grad_cut or act_cut,
        "grad": grad, "activations": acts,
        "events": sorted(grad_events + act_events, key=lambda p: p["step"]),
    }


def _layer_envelope(run: Run, rank: int, index: int, name: str,
                    summary: SimpleNamespace, max_points: int) -> dict:
    """A long range of one layer from the step summaries: per bucket of SUMMARY_STEPS
    (several merged when there are more than `max_points`), the largest and smallest grad
    norm and the largest activation abs-max; buckets whose largest is non-finite are also
    `events`."""
    starts, grad_max = summary.bucket_start, summary.grad_max[:, index:index + 1]
    grad_min, acts_max = summary.grad_min[:, index], summary.act_max[:, index:index + 1]
    if len(starts) > max_points:  # merge neighbouring buckets: max of maxima, min of minima
        width = math.ceil(len(starts) / max_points)
        groups = np.arange(len(starts)) // width
        lows = np.where((grad_min == MISSING) | ~np.isfinite(grad_min), np.inf, grad_min)
        grad_min = np.full(groups[-1] + 1, np.inf)
        np.minimum.at(grad_min, groups, lows)
        grad_min[np.isinf(grad_min)] = MISSING
        merged, _, grad_max, empty = bucket_matrix(starts, grad_max, max_points)
        grad_max = np.where(empty.T, MISSING, grad_max.T)
        _, _, acts_max, acts_empty = bucket_matrix(starts, acts_max, max_points)
        acts_max = np.where(acts_empty.T, MISSING, acts_max.T)
        starts = merged
    grad_max, acts_max = grad_max[:, 0], acts_max[:, 0]
    highs = encode_float_array(grad_max, missing=grad_max == MISSING)
    lows = encode_float_array(grad_min, missing=grad_min == MISSING)
    grad = [{"step": s, "grad_norm": hi, "grad_norm_min": lo}
            for s, hi, lo in zip(starts.tolist(), highs, lows, strict=True)]
    sampled = acts_max != MISSING
    acts = [{"step": s, "grad_norm": None, "act_absmax": v}
            for s, v in zip(starts[sampled].tolist(), encode_float_array(acts_max[sampled]),
                            strict=True)]
    events = [point for point in grad if isinstance(point["grad_norm"], str)]
    events += [point for point in acts if isinstance(point["act_absmax"], str)]
    return {"run_id": run.id, "rank": rank, "layer": index, "name": name,
            "total": summary.n_steps, "downsampled": True, "grad": grad, "activations": acts,
            "events": sorted(events, key=lambda point: point["step"])}


def matrix_query(
    session: Session,
    run: Run,
    *,
    metric: str = "grad_norm",
    rank: int = 0,
    start: int | None = None,
    end: int | None = None,
    buckets: int = 1000,
    layers: Sequence[int] | None = None,
) -> dict:
    """Layers x step buckets for heatmaps (see downsample.bucket_matrix); with `layers`
    (indices), only those layers' rows, in that order: a page of a wide run reads and
    sends its own layers only."""
    if metric not in MATRIX_METRICS:
        raise InvalidInput(f"metric must be one of {', '.join(MATRIX_METRICS)}")
    if metric in SIGNALS:  # sampled spike signals (server/store/spike_samples.py)
        return _spike_matrix(session, run, metric, rank, start, end, buckets, layers)
    acts = metric != "grad_norm"
    columns = None if layers is None else np.asarray(layers, dtype=np.int64)
    summary = (_summarised(session, run, rank, start, end, columns, envelope=False,
                           blocks=("act_max" if acts else "grad_max",))
               if metric != "act_time_ms" else None)
    if summary is not None:  # one column per summary bucket, reduced by the same rule
        steps = summary.bucket_start
        values = summary.act_max if acts else summary.grad_max
    else:
        series = load_series(session, run.id, rank, start, end, n_layers=run.n_layers,
                             with_layers=not acts, with_acts=acts, layers=columns)
        if acts:
            steps = series.act_step
            values = series.act_absmax if metric == "act_absmax" else series.act_time
        else:
            steps, values = series.steps, series.layer_grad
    if layers is None:
        names = [row.name for row in layer_rows(session, run.id)]
    else:  # only the page's names, in the order asked
        by_index = {row.index: row.name for row in layer_rows(session, run.id, layers)}
        names = [by_index[i] for i in layers]
    if values is None:
        steps, values = steps[:0], np.zeros((0, len(names)), np.float32)
    step_start, step_end, matrix, empty = bucket_matrix(steps, values, buckets)
    if summary is not None and step_end.size:  # a bucket's column ends where its steps do
        step_end = step_end + SUMMARY_STEPS - 1
    return {
        "run_id": run.id,
        "rank": rank,
        "metric": metric,
        "layers": names,
        "step_start": step_start.tolist(),
        "step_end": step_end.tolist(),
        "values": FloatRows(matrix, empty),
    }


def _spike_matrix(session: Session, run: Run, metric: str, rank: int, start: int | None,
                  end: int | None, buckets: int, layers: Sequence[int] | None) -> dict:
    rows = layer_rows(session, run.id, layers)
    by_index = {row.index: row.name for row in rows}
    indices = list(layers) if layers is not None else sorted(by_index)
    return {"run_id": run.id, "rank": rank, "metric": metric,
            "layers": [by_index[i] for i in indices],
            **spike_matrix(session, run.id, rank, metric, indices, start=start, end=end,
                           buckets=buckets)}
