"""Read queries behind the API and the pages (every page's JSON twin calls these).

Each returns a plain dict shaped like its schema in server/schemas.py, with
non-finite floats already in wire form, so a 2,000-point answer is built with a few
numpy passes and one `json.dumps`.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy.orm import Session

from ampwatch.client.wire import encode_array, encode_float
from ampwatch.server.downsample import bucket_matrix, keep_extremes
from ampwatch.server.errors import InvalidInput, NotFound
from ampwatch.server.models import Run
from ampwatch.server.responses import float_rows
from ampwatch.server.runs import run_ranks
from ampwatch.server.series import (
    BOOL_FIELDS,
    DTYPES,
    INT_FIELDS,
    MISSING,
    SCALAR_FIELDS,
    StepSeries,
)
from ampwatch.server.storage import (
    ACT_DTYPE,
    ACT_MAX,
    ACT_NONFINITE,
    GRAD_LAST,
    GRAD_MAX,
    GRAD_NONFINITE,
    TIME_COUNT,
    TIME_SUM,
    layer_stats,
    load_layers,
    load_series,
)

MATRIX_METRICS = ("grad_norm", "act_absmax", "act_time_ms")


def _ranks(session: Session, run: Run, rank: int | None) -> list[int]:
    ranks = [r.rank for r in run_ranks(session, run.id)]
    if rank is None:
        return ranks
    return [rank]


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
        elif name in INT_FIELDS:
            col = [int(v) if p else None for v, p in zip(values.tolist(), present.tolist(),
                                                         strict=True)]
        else:
            col = encode_array(values, missing=~present)
        columns[name] = col
    names = list(columns)
    return [
        {"rank": rank, **dict(zip(names, row, strict=True))}
        for row in zip(*columns.values(), strict=True)
    ]


def always_kept(series: StepSeries) -> np.ndarray:
    """Steps that downsampling must never drop: skipped or non-finite."""
    keep = series.skipped.copy()
    for name in ("grad_norm", "loss", "loss_scale"):
        col = series.column(name)
        keep |= series.has(name) & ~np.isfinite(col)
    keep |= series.column("input_nonfinite") == 1
    keep |= series.column("forward_nonfinite") == 1
    return keep


def steps_query(
    session: Session,
    run: Run,
    *,
    rank: int | None = None,
    start: int | None = None,
    end: int | None = None,
    max_points: int | None = None,
    limit: int = 10_000,
) -> dict:
    """Step records in [start, end]. With max_points: downsampled per rank so that the
    extremes of loss_scale, grad_norm and loss and every skipped or non-finite step
    survive. Without: the first `limit` steps, with `next_start` for the rest."""
    ranks = _ranks(session, run, rank)
    items: list[dict] = []
    total = 0
    downsampled = False
    next_start = None
    budget = max(1, (max_points or 0) // max(1, len(ranks)))
    for r in ranks:
        series = load_series(session, run.id, r, start, end, n_layers=run.n_layers,
                             with_layers=False, with_acts=False)
        total += len(series)
        if max_points is not None:
            if len(series) > budget:
                downsampled = True
                columns = [series.column(n) for n in ("loss_scale", "grad_norm", "loss")]
                series = series.take(keep_extremes(columns, always_kept(series), budget))
        elif len(series) > limit:
            cut = series.steps[limit]
            next_start = int(cut) if next_start is None else min(next_start, int(cut))
            series = series.take(np.arange(limit))
        items.extend(_step_rows(series, r))
    if next_start is not None:  # ranks cut at different steps: the page ends at the first cut
        items = [row for row in items if row["step"] < next_start]
    items.sort(key=lambda row: (row["step"], row["rank"]))
    return {
        "run_id": run.id,
        "total": total,
        "count": len(items),
        "downsampled": downsampled,
        "next_start": next_start,
        "items": items,
    }


def _float_or_none(x: float) -> float | str | None:
    """A running-summary value; negative (the "none yet" marker) becomes None."""
    return None if np.isfinite(x) and x < 0 else encode_float(float(x))


def layers_query(session: Session, run: Run, *, rank: int = 0) -> dict:
    """The layer table with per-layer summaries kept up to date at ingest."""
    layers = load_layers(session, run.id)
    rank_row = next((r for r in run_ranks(session, run.id) if r.rank == rank), None)
    stats = layer_stats(rank_row, len(layers))
    items = []
    for layer in layers:
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
            extra: dict[str, list] | None = None) -> tuple[list[dict], bool]:
    index = np.arange(len(steps))
    if max_points is not None and len(steps) > max_points:
        col = np.where(values == MISSING, np.nan, values.astype(np.float64))
        index = keep_extremes([col], ~np.isfinite(values), max_points)
    encoded = encode_array(values[index], missing=values[index] == MISSING)
    points = [{"step": int(s), "value": v} for s, v in zip(steps[index].tolist(), encoded,
                                                            strict=True)]
    for name, col in (extra or {}).items():
        for p, i in zip(points, index.tolist(), strict=True):
            p[name] = col[i]
    return points, len(index) < len(steps)


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
    layer = load_layers(session, run.id)[index]
    series = load_series(session, run.id, rank, start, end, n_layers=run.n_layers, layer=index)
    grad_values = (series.layer_grad[:, 0] if series.layer_grad is not None
                   else np.full(len(series), MISSING, np.float32))
    grad, grad_cut = _points(series.steps, grad_values, max_points)
    for p in grad:
        p["grad_norm"] = p.pop("value")
    acts: list[dict] = []
    act_cut = False
    if series.act_absmax is not None:
        dtype_names = [DTYPES[c] or None for c in series.act_dtype[:, 0].tolist()]
        times = encode_array(series.act_time[:, 0], missing=series.act_time[:, 0] == MISSING)
        acts, act_cut = _points(series.act_step, series.act_absmax[:, 0], max_points,
                                {"act_dtype": dtype_names, "act_time_ms": times})
        for p in acts:
            p["act_absmax"] = p.pop("value")
            p["grad_norm"] = None
    return {
        "run_id": run.id, "rank": rank, "layer": index, "name": layer.name,
        "total": len(series), "downsampled": grad_cut or act_cut,
        "grad": grad, "activations": acts,
    }


def matrix_query(
    session: Session,
    run: Run,
    *,
    metric: str = "grad_norm",
    rank: int = 0,
    start: int | None = None,
    end: int | None = None,
    buckets: int = 1000,
) -> dict:
    """Layers x step buckets for heatmaps (see downsample.bucket_matrix)."""
    if metric not in MATRIX_METRICS:
        raise InvalidInput(f"metric must be one of {', '.join(MATRIX_METRICS)}")
    acts = metric != "grad_norm"
    series = load_series(session, run.id, rank, start, end, n_layers=run.n_layers,
                         with_layers=not acts, with_acts=acts)
    if acts:
        steps = series.act_step
        values = series.act_absmax if metric == "act_absmax" else series.act_time
    else:
        steps, values = series.steps, series.layer_grad
    if values is None:
        steps, values = steps[:0], np.zeros((0, run.n_layers), np.float32)
    step_start, step_end, matrix, empty = bucket_matrix(steps, values, buckets)
    return {
        "run_id": run.id,
        "rank": rank,
        "metric": metric,
        "layers": [layer.name for layer in load_layers(session, run.id)],
        "step_start": step_start.tolist(),
        "step_end": step_end.tolist(),
        "values": float_rows(matrix, empty),
    }
