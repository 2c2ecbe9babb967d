"""The loss-scale chart: a log2 axis with ticks at whole powers of two, skipped steps
shaded as spans that name themselves on hover, and a scale that collapsed drawn on one
row under 2^SCALE_FLOOR with the step it fell at. A pure `lines -> Figure` builder."""

from __future__ import annotations

import math

import numpy as np

from ampwatch.server.pages.columns import StepColumns
from ampwatch.server.pages.figures import (
    CRITICAL,
    base_figure,
    colour,
    label,
    legend_if_many,
    note,
    share_x,
    step_span,
)
from ampwatch.server.pages.plot import Figure

SCALE_FLOOR = -24  # log2: a loss scale below 2^-24 is collapsed, whatever its value


def log2_ticks(low: float, high: float, most: int = 7) -> list[int]:
    """Whole powers of two between `low` and `high` (log2 units), at most `most` of them,
    spaced by a power-of-two stride and counted down from the top (the scale a run
    starts at, 2^16 by default, is always labelled)."""
    stride = 1
    while (high - low) / stride > most - 1:
        stride *= 2
    top = math.floor(high)
    return list(range(top - (top - math.ceil(low)) // stride * stride, top + 1, stride))


def streaks(steps: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) step of each run of consecutive steps where `mask` holds. Exact on
    downsampled lines, which keep every skipped step."""
    chosen = steps[mask]
    if not chosen.size:
        return []
    breaks = np.flatnonzero(np.diff(chosen) != 1)
    firsts = np.concatenate([chosen[:1], chosen[breaks + 1]])
    lasts = np.concatenate([chosen[breaks], chosen[-1:]])
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def _spans(fig: Figure, spans: list[tuple[int, int]], low: float, high: float, *,
           name: str, colour: str, legend: str, owner: str, several: bool = False) -> None:
    """Shaded bands over step spans (one filled trace, however many spans), and at each
    of their steps an invisible point whose hover names the run and the span: "skipped:
    steps 73-406 (334)"."""
    if not spans:
        return
    x: list[float | None] = []
    y: list[float | None] = []
    for first, last in spans:
        x += [first - 0.5, first - 0.5, last + 0.5, last + 0.5, first - 0.5, None]
        y += [low, high, high, low, low, None]
    title = f"{owner}: {name}" if several else name
    fig.add_scatter(
        x=x, y=y, mode="lines", fill="toself", fillcolor=colour, line={"width": 0},
        name=title, legendgroup=legend, hoverinfo="skip",
        showlegend=not any(t.get("legendgroup") == legend for t in fig.data),
    )
    steps = np.concatenate([np.arange(a, b + 1) for a, b in spans])
    bounds = np.concatenate([np.tile([a, b, b - a + 1], (b - a + 1, 1)) for a, b in spans])
    fig.add_scatter(
        x=steps, y=np.full(steps.size, high), customdata=bounds, mode="markers",
        marker={"opacity": 0, "size": 1}, name=title, legendgroup=legend, showlegend=False,
        hovertemplate="skipped: steps %{customdata[0]}-%{customdata[1]} "
                      "(%{customdata[2]:,} in this span)",
    )


def scale_words(scales: np.ndarray) -> list[str]:
    """Each scale as the stats tile writes it: '2^16' for a power of two (GradScaler's
    scales are), else its value."""
    exponents = np.log2(scales)
    return [f"2^{int(e)}" if e == int(e) else f"{v:.6g}"
            for v, e in zip(scales.tolist(), exponents.tolist(), strict=True)]


def loss_scale_figure(lines: list[StepColumns], *, scaler: bool = False) -> Figure:
    """Loss scale on a log2 axis (ticks at whole powers of two), skipped steps shaded as
    spans (hovering one names its run and its first and last step); the x axis spans
    every step. A scale that collapsed does not stretch the axis to 2^-149: scales under
    2^SCALE_FLOOR and a scale of 0 are drawn on one row below it, labelled, with the
    step it fell at. `scaler`: the run reported a GradScaler (its chart waits for data
    rather than saying there is none)."""
    fig = base_figure()
    drawn, lows, highs = [], [], []
    for i, line in enumerate(lines):
        scale = line.values["loss_scale"]
        sent = line.present["loss_scale"]
        positive = sent & np.isfinite(scale) & (scale > 0)
        log_scale = np.log2(np.where(positive, scale, 1.0))
        ok = positive & (log_scale >= SCALE_FLOOR)
        fallen = sent & ((positive & ~ok) | (scale == 0))
        if not ok.any() and not fallen.any():
            continue
        if ok.any():
            lows.append(float(log_scale[ok].min()))
            highs.append(float(log_scale[ok].max()))
            fig.add_scatter(
                x=line.steps[ok], y=log_scale[ok], customdata=scale[ok], mode="lines",
                line={"color": colour(i), "width": 1.6, "shape": "hv"}, name=label(line.label),
                text=scale_words(scale[ok]), hovertemplate="scale %{text}",
            )
        drawn.append((i, line, fallen))
    if not drawn:
        return note(fig, "no loss scale recorded yet" if scaler
                    else "no loss scale recorded (no GradScaler in this run)")
    any_fallen = any(fallen.any() for _, _, fallen in drawn)
    low = math.floor(min(lows, default=float(SCALE_FLOOR)))
    high = math.ceil(max(highs, default=0.0))
    if any_fallen:
        low = min(low, SCALE_FLOOR) - 2  # the fallen row, below the smallest drawn scale
    bottom, top = low - 0.5, high + 0.5
    for i, line, fallen in drawn:
        if fallen.any():
            _fallen(fig, line, fallen, float(low), several=len(lines) > 1)
        tint = "rgba(217,48,37,0.16)" if len(lines) == 1 else _tint(colour(i))
        _spans(fig, streaks(line.steps, line.skipped), bottom, top, name="skipped steps",
               colour=tint, legend=f"skipped-{i}" if len(lines) > 1 else "skipped",
               owner=label(line.label), several=len(lines) > 1)
    ticks = log2_ticks(low + 2 if any_fallen and lows else low, high)
    if any_fallen:  # room for the fallen row's label
        ticks = [k for k in ticks if k - low >= 4 or k == high] or ticks[-1:]
    text = [f"2<sup>{k}</sup>" for k in ticks]
    if any_fallen:
        zeros = any((line.values["loss_scale"][fallen] == 0).any() for _, line, fallen in drawn)
        ticks, text = [low, *ticks], ["0" if zeros else f"<2<sup>{SCALE_FLOOR}</sup>", *text]
    fig.update_yaxes(tickvals=ticks, ticktext=text, range=[bottom, top],
                     title={"text": "loss scale"})
    if low <= 0 <= high:
        fig.add_hline(y=0, line={"color": CRITICAL, "dash": "dot", "width": 1},
                      annotation={"text": "scale 1", "font": {"color": CRITICAL}},
                      annotation_position="bottom right")
    share_x(fig, step_span(lines))
    legend_if_many(fig, lines)
    return fig


def _fallen(fig: Figure, line: StepColumns, fallen: np.ndarray, row: float, *,
            several: bool) -> None:
    """Steps whose scale fell under 2^SCALE_FLOOR (or to 0) on the row below the axis's
    powers of two, and a note at the first: "fell to 0 at step 357"."""
    values = line.values["loss_scale"][fallen]
    owner = f"{label(line.label)}: " if several else ""
    name = "scale 0" if (values == 0).all() else f"scale below 2^{SCALE_FLOOR}"
    fig.add_scatter(
        x=line.steps[fallen], y=np.full(int(fallen.sum()), row), customdata=values,
        mode="markers", marker={"symbol": "line-ew", "size": 8, "color": CRITICAL,
                                "line": {"width": 2, "color": CRITICAL}},
        name=owner + name, legendgroup=f"fallen-{owner}",
        hovertemplate="scale %{customdata:.3g}",
    )
    first = int(line.steps[fallen][0])
    to = "0" if values[0] == 0 else f"below 2^{SCALE_FLOOR}"
    # the note reads leftwards from a fall late in the run, so that it stays in the chart
    late = first > (int(line.steps[0]) + int(line.steps[-1])) / 2
    fig.add_annotation(x=first, y=row, text=f"{owner}fell to {to} at step {first:,}",
                       showarrow=False, xanchor="right" if late else "left",
                       yanchor="bottom", font={"color": CRITICAL, "size": 11})


def _tint(hex_colour: str, alpha: float = 0.14) -> str:
    r, g, b = (int(hex_colour[k:k + 2], 16) for k in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"
