"""Figure builders for /runs/{id}/layers: per-layer heatmaps and forward time by dtype.

Pure `data -> Figure` functions over the JSON twins of `matrix_query` and
`layers_query`. Heatmaps use a log10 colour scale; non-finite cells get a red overlay
of their own and the first offender (earliest bucket, first layer in forward order)
is marked, so a NaN never hides in the colour scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from plotly.colors import get_colorscale

from ampwatch.server.pages.columns import LayerMatrix
from ampwatch.server.pages.figures import CRITICAL, MUTED, base_figure, label, note
from ampwatch.server.pages.plot import Figure

NAN_COLOUR = "#7f1d1d"  # NaN cells: a darker shade of the critical red used for inf
DTYPE_COLOURS = {"float16": "#1a73e8", "bfloat16": "#12a4af", "float32": "#e8710a",
                 "float64": "#9334e6", "float8_e4m3fn": "#0b8043", "float8_e5m2": "#0b8043",
                 "int8": "#6b5bd2", "mixed": MUTED}
UNKNOWN_DTYPE = "#bdc1c6"
# Plotly's Viridis as stops: plotly.js's own "Viridis" has other stops
VIRIDIS = get_colorscale("Viridis")
ROW_PX = 20


def forward_key(index: int, forward_index: int | None) -> tuple[bool, int, int]:
    """Sort key of a layer in forward execution order; layers never seen in forward last."""
    return forward_index is None, forward_index or 0, index


def forward_order(layers: dict) -> list[int]:
    """Layer indices of a `layers_query` answer in forward execution order."""
    return [item["index"] for item in sorted(
        layers["items"], key=lambda x: forward_key(x["index"], x["forward_index"]))]


def layer_title(item: dict) -> str:
    """A layer's name with its type, as `nn.Sequential` names say nothing alone:
    "6 · Linear(256, 256)" (in, out features from its weight's shape), "norm · LayerNorm"."""
    kind = item.get("type") or ""
    weight = (item.get("shapes") or {}).get("weight")
    if kind == "Linear" and weight and len(weight) == 2:
        kind = f"Linear({weight[1]}, {weight[0]})"
    return f"{item['name']} · {kind}" if kind else item["name"]


@dataclass(frozen=True)
class FirstOffender:
    """The earliest non-finite cell: its layer (first in forward order) and bucket."""

    layer: str
    step_start: int
    step_end: int
    value: str  # "NaN", "+inf" or "-inf"


def bucket_edges(matrix: LayerMatrix) -> np.ndarray:
    """Cell edges on the step axis: a bucket of steps a..b spans a-0.5..b+0.5, so a
    heatmap lines up with the step charts, where step s sits at x = s."""
    if not matrix.step_start.size:
        return np.zeros(0)
    return np.concatenate([matrix.step_start - 0.5, matrix.step_end[-1:] + 0.5])


def matrix_span(matrices: list[LayerMatrix]) -> tuple[int, int] | None:
    """First and last step over the matrices' buckets: the layers page's one x range."""
    spans = [(int(m.step_start[0]), int(m.step_end[-1])) for m in matrices
             if m.step_start.size]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def heatmap_height(n_layers: int) -> int:
    return int(min(max(ROW_PX * n_layers + 100, 240), 720))


def first_offender(matrix: LayerMatrix) -> FirstOffender | None:
    """The first non-finite cell of a layer matrix (its rows in forward order, as the
    matrix queries return them)."""
    rows = matrix.values
    if not rows.size:
        return None
    bad = ~np.isfinite(rows)
    if not bad.any():
        return None
    bucket = int(np.flatnonzero(bad.any(axis=0))[0])
    row = int(np.flatnonzero(bad[:, bucket])[0])
    cell = rows[row, bucket]
    return FirstOffender(
        layer=matrix.layers[row], step_start=int(matrix.step_start[bucket]),
        step_end=int(matrix.step_end[bucket]),
        value="NaN" if math.isnan(cell) else ("+inf" if cell > 0 else "-inf"),
    )


def layer_heatmap_figure(matrix: LayerMatrix, *, quantity: str,
                         offender: str | None = None,
                         titles: dict[str, str] | None = None,
                         limit: tuple[str, float] | None = None) -> Figure:
    """Layers (rows in the matrix's order, forward order, top first) x step buckets of
    `quantity`.

    Colour is log10 of the bucket's largest finite value; empty buckets stay blank;
    inf and NaN cells are drawn by red overlays, each layer's first bad bucket gets a
    marker and the `offender` layer (the run's first offender) a labelled star.
    `titles`: the row label of each layer name (its name with its type). `limit`: a
    dtype's name and largest value, marked on the colour bar ("fp16 max 65504").
    """
    values, empty = matrix.values, matrix.empty
    n_layers = len(matrix.layers)
    fig = base_figure(heatmap_height(n_layers), hovermode="closest")
    if not values.size or empty.all():
        return note(fig, f"no {quantity} recorded yet")
    names = [label((titles or {}).get(layer, layer)) for layer in matrix.layers]
    x = matrix.step_start
    edges = bucket_edges(matrix)
    finite = np.isfinite(values) & ~empty
    if finite.any():
        _add_log_heatmap(fig, edges, names, values, finite, quantity, limit)
    bad = ~np.isfinite(values) & ~empty
    if bad.any():
        for cells, name, fill in ((np.isposinf(values) | np.isneginf(values), "inf", CRITICAL),
                                  (np.isnan(values) & ~empty, "NaN", NAN_COLOUR)):
            if not cells.any():
                continue
            # hoverongaps off: the overlay's empty cells (every finite one) must not take
            # the hover from the value heatmap below
            fig.add_heatmap(
                x=edges, y=names, z=np.where(cells, 1.0, np.nan).astype(np.float32), zmin=0,
                zmax=1, showscale=False, name=name, colorscale=[[0, fill], [1, fill]],
                hoverongaps=False,
                hovertemplate=f"%{{y}}<br>step %{{x:.0f}}: {name}<extra></extra>",
            )
            # a heatmap has no legend entry: a square of its colour stands for it
            fig.add_scatter(x=[None], y=[None], mode="markers", name=name,
                            marker={"symbol": "square", "size": 10, "color": fill},
                            showlegend=True, hoverinfo="skip")
        rows = np.flatnonzero(bad.any(axis=1))
        first_bucket = bad[rows].argmax(axis=1)
        fig.add_scatter(
            x=x[first_bucket], y=[names[r] for r in rows], mode="markers",
            marker={"symbol": "square-open", "size": 9, "color": CRITICAL,
                    "line": {"width": 2}},
            name="first non-finite of a layer", showlegend=True,
            hovertemplate="%{y}: first non-finite at step %{x}<extra></extra>",
        )
        _mark_offender(fig, offender, matrix, names, x, bad)
        fig.update_layout(showlegend=True)
    fig.update_yaxes(autorange="reversed", showgrid=False, type="category")
    fig.update_xaxes(showgrid=False)
    fig.update_layout(plot_bgcolor="#f1f3f4", margin={"l": 8})
    return fig


def _add_log_heatmap(fig: Figure, x: np.ndarray, names: list[str], values: np.ndarray,
                     finite: np.ndarray, quantity: str,
                     limit: tuple[str, float] | None = None) -> None:
    # float32 and masked reductions, no boolean gathers: a 1,000 x 1,000 heatmap costs
    # a few ms rather than tens
    values = values.astype(np.float32, copy=False)
    floor = float(np.min(values, where=finite & (values > 0), initial=np.inf))
    if not math.isfinite(floor):
        floor = 1.0
    z = np.full(values.shape, np.nan, dtype=np.float32)
    np.log10(np.maximum(values, np.float32(floor)), out=z, where=finite)
    low = math.floor(float(np.min(z, where=finite, initial=np.inf)))
    high = max(math.ceil(float(np.max(z, where=finite, initial=-np.inf))), low + 1)
    stride = max(1, math.ceil((high - low) / 6))
    ticks: list[float] = list(range(low, high + 1, stride))
    text = [f"1e{k}" for k in ticks]
    if limit is not None and low <= math.log10(limit[1]) <= high + 1:
        # the dtype's maximum on the bar: how close the hottest cells came to it
        high = max(high, math.ceil(math.log10(limit[1])))
        mark = math.log10(limit[1])
        keep = [k for k in ticks if abs(k - mark) > 0.3]
        ticks, text = [*keep, mark], [*(f"1e{k}" for k in keep), f"{limit[0]} max {limit[1]:g}"]
    # app.js fills customdata with 10**z once drawn (meta "log10"): the hover reads 0.5,
    # not 10^-0.30, without sending every value twice
    fig.add_heatmap(
        x=x, y=names, z=z, zmin=low, zmax=high, colorscale=VIRIDIS, name=quantity,
        colorbar={"title": {"text": "log10", "side": "right"}, "tickvals": ticks,
                  "ticktext": text, "thickness": 12, "len": 0.9},
        hoverongaps=False, meta="log10",
        hovertemplate="%{y}<br>step %{x:.0f}<br>" + quantity
        + " %{customdata:.4~g}<extra></extra>",
    )


def _mark_offender(fig: Figure, offender: str | None, matrix: LayerMatrix,
                   names: list[str], x: np.ndarray, bad: np.ndarray) -> None:
    """A star and a label at the offender layer's first non-finite bucket."""
    rows = [r for r, layer in enumerate(matrix.layers) if layer == offender]
    if not rows or not bad[rows[0]].any():
        return
    row = rows[0]
    bucket = int(bad[row].argmax())
    fig.add_scatter(
        x=[x[bucket]], y=[names[row]], mode="markers",
        marker={"symbol": "star", "size": 16, "color": CRITICAL,
                "line": {"width": 1, "color": "white"}},
        name="first offender", showlegend=True,
        hovertemplate="first offender: %{y}<br>non-finite from step %{x}<extra></extra>",
    )
    right = bucket > len(x) / 2  # the label points inwards, clear of the colour bar
    fig.add_annotation(x=x[bucket], y=names[row], ax=-60 if right else 60, ay=-18,
                       xanchor="right" if right else "left",
                       text=f"first offender: {label(offender)}", font={"color": CRITICAL},
                       arrowcolor=CRITICAL, bgcolor="rgba(255,255,255,0.9)")


def forward_time_figure(layers: dict, order: list[int]) -> Figure:
    """Mean forward time of each layer (forward order), one colour per computed dtype."""
    items = {item["index"]: item for item in layers["items"]}
    timed = [items[i] for i in order if items[i]["summary"]["fwd_time_mean_ms"] is not None]
    fig = base_figure(300, x_title="layer (forward order)", hovermode="closest")
    if not timed:
        return note(fig, "no forward timings sampled yet")
    by_dtype: dict[str, list[dict]] = {}
    for item in timed:
        by_dtype.setdefault(item["summary"]["act_dtype"] or "unknown", []).append(item)
    for dtype, group in by_dtype.items():
        fig.add_bar(
            x=[label(item["name"]) for item in group],
            y=[item["summary"]["fwd_time_mean_ms"] for item in group],
            name=dtype, marker={"color": DTYPE_COLOURS.get(dtype, UNKNOWN_DTYPE)},
            hovertemplate="%{x}<br>%{y:.3g} ms in " + dtype + "<extra></extra>",
        )
    fig.update_xaxes(type="category", categoryorder="array",
                     categoryarray=[label(item["name"]) for item in timed], tickangle=-45)
    fig.update_yaxes(title={"text": "mean forward time (ms)"}, rangemode="tozero")
    fig.update_layout(showlegend=True, bargap=0.15)
    return fig
