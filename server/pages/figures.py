"""Plotly figure builders for the step charts: pure `data -> Figure` functions.

Each takes `StepColumns` lines (a run's ranks, or several runs on /compare) built
from the pages' JSON twins, and never drops a problem: skipped steps and non-finite
values are drawn as red markers, never left out. Names a client sent are HTML-escaped
here because Plotly renders a subset of HTML in trace names and labels.
"""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go

from ampwatch.server.pages.columns import StepColumns

# One meaning per colour, everywhere (server/pages/static/app.css uses the same values).
CRITICAL = "#d93025"
WARNING = "#e37400"
HEALTHY = "#188038"
MUTED = "#5f6368"
GRID = "#eceff1"
LINE_COLOURS = ("#1a73e8", "#12a4af", "#9334e6", "#e8710a", "#3c4043", "#0b8043",
                "#b0630b", "#6b5bd2")
PHASE_COLOURS = {"t_forward_ms": "#1a73e8", "t_backward_ms": "#12a4af",
                 "t_optimizer_ms": "#9334e6"}
PHASE_NAMES = {"t_forward_ms": "forward", "t_backward_ms": "backward",
               "t_optimizer_ms": "optimizer"}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
CHART_HEIGHT = 260


def label(text: str) -> str:
    """A client-sent name made safe for Plotly's HTML-ish text rendering."""
    return html.escape(text, quote=False)


def colour(i: int) -> str:
    return LINE_COLOURS[i % len(LINE_COLOURS)]


def base_figure(height: int = CHART_HEIGHT, *, x_title: str = "step") -> go.Figure:
    """An empty figure in the dashboard's style; `uirevision` keeps zoom across updates."""
    axis = {"gridcolor": GRID, "zeroline": False, "linecolor": "#dadce0",
            "ticks": "outside", "tickcolor": "#dadce0", "automargin": True}
    return go.Figure(layout={
        "template": "none",
        "height": height,
        "margin": {"l": 56, "r": 16, "t": 28, "b": 40},
        "font": {"family": FONT, "size": 12, "color": "#3c4043"},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "xaxis": {**axis, "title": {"text": x_title, "standoff": 6}},
        "yaxis": dict(axis),
        "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0,
                   "yanchor": "bottom", "bgcolor": "rgba(255,255,255,0)"},
        "hovermode": "closest",
        "uirevision": "keep",
        "showlegend": False,
    })


def note(fig: go.Figure, message: str) -> go.Figure:
    """A figure that says why it is empty instead of showing blank axes."""
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper",
                       showarrow=False, font={"color": MUTED, "size": 13})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _legend_if_many(fig: go.Figure, lines: list[StepColumns]) -> None:
    if len(lines) > 1 or any(trace.showlegend for trace in fig.data):
        fig.update_layout(showlegend=True)


def _nonfinite_markers(fig: go.Figure, line: StepColumns, name: str, top: float) -> None:
    """Red triangles along the top edge at steps whose value was NaN or infinite."""
    bad = line.nonfinite(name)
    if not bad.any():
        return
    values = line.values[name][bad]
    text = np.where(np.isnan(values), "NaN", np.where(values > 0, "+inf", "-inf"))
    fig.add_scatter(
        x=line.steps[bad], y=np.full(int(bad.sum()), top), mode="markers",
        marker={"symbol": "triangle-down", "size": 9, "color": CRITICAL},
        name="non-finite", legendgroup="non-finite",
        showlegend=not any(t.legendgroup == "non-finite" for t in fig.data),
        text=text, hovertemplate="step %{x}: %{text}<extra>" + label(line.label) + "</extra>",
    )


def loss_scale_figure(lines: list[StepColumns]) -> go.Figure:
    """Loss scale on a log2 axis (ticks 2^k), every skipped step marked in red."""
    fig = base_figure()
    lows, highs = [], []
    for i, line in enumerate(lines):
        scale = line.values["loss_scale"]
        ok = line.present["loss_scale"] & np.isfinite(scale) & (scale > 0)
        if not ok.any():
            continue
        log_scale = np.log2(scale[ok])
        lows.append(float(log_scale.min()))
        highs.append(float(log_scale.max()))
        fig.add_scatter(
            x=line.steps[ok], y=log_scale, customdata=scale[ok], mode="lines",
            line={"color": colour(i), "width": 1.6, "shape": "hv"}, name=label(line.label),
            hovertemplate="step %{x}<br>scale %{customdata:.6g}<extra>%{fullData.name}</extra>",
        )
        skipped = line.skipped & ok
        if skipped.any():
            fig.add_scatter(
                x=line.steps[skipped], y=log_scale[skipped[ok]], customdata=scale[skipped],
                mode="markers", marker={"symbol": "x-thin", "size": 7, "color": CRITICAL,
                                        "line": {"width": 2, "color": CRITICAL}},
                name="skipped step", legendgroup="skipped", showlegend=not any(
                    t.legendgroup == "skipped" for t in fig.data),
                hovertemplate="step %{x} skipped<br>scale %{customdata:.6g}<extra>"
                + label(line.label) + "</extra>",
            )
    if not lows:
        return note(fig, "no loss scale recorded (no GradScaler in this run)")
    low, high = math.floor(min(lows)), math.ceil(max(highs))
    stride = max(1, math.ceil((high - low + 1) / 7))
    ticks = list(range(low, high + 1, stride))
    fig.update_yaxes(tickvals=ticks, ticktext=[f"2<sup>{k}</sup>" for k in ticks],
                     range=[low - 0.5, high + 0.5], title={"text": "loss scale (log2)"})
    if low <= 1:
        fig.add_hline(y=0, line={"color": CRITICAL, "dash": "dot", "width": 1},
                      annotation_text="scale 1", annotation_font_color=CRITICAL,
                      annotation_position="bottom right")
    _legend_if_many(fig, lines)
    return fig


def grad_norm_figure(lines: list[StepColumns]) -> go.Figure:
    """Total grad norm on a log axis; NaN/inf steps as red markers along the top."""
    fig = base_figure()
    positive = [line.values["grad_norm"][line.finite("grad_norm") & (line.values["grad_norm"] > 0)]
                for line in lines]
    highs = [float(p.max()) for p in positive if p.size]
    top = max(highs) * 4 if highs else 1.0
    for i, line in enumerate(lines):
        norm = line.values["grad_norm"]
        ok = np.isfinite(norm) & (norm > 0)
        fig.add_scatter(
            x=line.steps[ok], y=norm[ok], mode="lines", name=label(line.label),
            line={"color": colour(i), "width": 1.4},
            hovertemplate="step %{x}<br>grad norm %{y:.4g}<extra>%{fullData.name}</extra>",
        )
        _nonfinite_markers(fig, line, "grad_norm", top)
    if not any(line.present["grad_norm"].any() for line in lines):
        return note(fig, "no grad norm recorded")
    fig.update_yaxes(type="log", title={"text": "grad norm (log)"}, exponentformat="power")
    _legend_if_many(fig, lines)
    return fig


def loss_figure(lines: list[StepColumns]) -> go.Figure:
    """Training loss; NaN/inf steps as red markers along the top."""
    fig = base_figure()
    finite = [line.values["loss"][line.finite("loss")] for line in lines]
    finite = [f for f in finite if f.size]
    if not finite and not any(line.present["loss"].any() for line in lines):
        return note(fig, "no loss recorded")
    high = max(float(f.max()) for f in finite) if finite else 1.0
    low = min(float(f.min()) for f in finite) if finite else 0.0
    top = high + 0.05 * max(high - low, abs(high), 1e-12)
    for i, line in enumerate(lines):
        ok = line.finite("loss")
        fig.add_scatter(
            x=line.steps[ok], y=line.values["loss"][ok], mode="lines", name=label(line.label),
            line={"color": colour(i), "width": 1.4},
            hovertemplate="step %{x}<br>loss %{y:.5g}<extra>%{fullData.name}</extra>",
        )
        _nonfinite_markers(fig, line, "loss", top)
    fig.update_yaxes(title={"text": "loss"})
    _legend_if_many(fig, lines)
    return fig


def lr_figure(lines: list[StepColumns]) -> go.Figure:
    """Learning rate of parameter group 0."""
    fig = base_figure()
    if not any(line.present["lr"].any() for line in lines):
        return note(fig, "no learning rate recorded")
    for i, line in enumerate(lines):
        ok = line.finite("lr")
        fig.add_scatter(
            x=line.steps[ok], y=line.values["lr"][ok], mode="lines", name=label(line.label),
            line={"color": colour(i), "width": 1.4, "shape": "hv"},
            hovertemplate="step %{x}<br>lr %{y:.4g}<extra>%{fullData.name}</extra>",
        )
    highs = [float(line.values["lr"][line.finite("lr")].max()) for line in lines
             if line.finite("lr").any()]
    top = max(highs, default=0.0)
    fig.update_yaxes(title={"text": "learning rate"}, exponentformat="e",
                     range=[0, top * 1.1] if top > 0 else None)
    _legend_if_many(fig, lines)
    return fig


def step_time(line: StepColumns) -> np.ndarray:
    """Step time in ms: `t_step_ms`, else the sum of the phases that were measured."""
    total = line.values["t_step_ms"].copy()
    measured = [line.present[p] & line.finite(p) for p in PHASE_NAMES]
    phases = sum((np.where(m, line.values[p], 0.0) for m, p in zip(measured, PHASE_NAMES,
                                                                    strict=True)),
                 start=np.zeros(len(line)))
    use = ~line.present["t_step_ms"] & np.logical_or.reduce(measured)
    total[use] = phases[use]
    return total


def phase_times_figure(lines: list[StepColumns]) -> go.Figure:
    """One run's forward, backward and optimizer times stacked; with several lines
    (ranks), each line's total step time."""
    fig = base_figure()
    if not any(line.present[p].any() for line in lines for p in (*PHASE_NAMES, "t_step_ms")):
        return note(fig, "no step timings recorded")
    if len(lines) == 1 and any(lines[0].present[p].any() for p in PHASE_NAMES):
        line = lines[0]
        for phase, name in PHASE_NAMES.items():
            ok = line.present[phase] & line.finite(phase)
            fig.add_scatter(
                x=line.steps[ok], y=line.values[phase][ok], mode="lines", name=name,
                stackgroup="phases", line={"color": PHASE_COLOURS[phase], "width": 0.8},
                hovertemplate=f"step %{{x}}<br>{name} %{{y:.3g}} ms<extra></extra>",
            )
        fig.update_layout(showlegend=True)
    else:
        for i, line in enumerate(lines):
            total = step_time(line)
            ok = np.isfinite(total)
            fig.add_scatter(
                x=line.steps[ok], y=total[ok], mode="lines", name=label(line.label),
                line={"color": colour(i), "width": 1.4},
                hovertemplate="step %{x}<br>step %{y:.3g} ms<extra>%{fullData.name}</extra>",
            )
        _legend_if_many(fig, lines)
    fig.update_yaxes(title={"text": "time (ms)"}, rangemode="tozero")
    return fig


def _memory_unit(high: float) -> tuple[float, str]:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if high >= unit:
            return unit, name
    return 1.0, "bytes"


def peak_memory_figure(lines: list[StepColumns]) -> go.Figure:
    """Peak device memory per step, in the largest binary unit that fits."""
    fig = base_figure()
    measured = [line.values["peak_mem_bytes"][line.finite("peak_mem_bytes")] for line in lines]
    measured = [m for m in measured if m.size]
    if not measured:
        return note(fig, "no peak memory recorded")
    unit, unit_name = _memory_unit(max(float(m.max()) for m in measured))
    for i, line in enumerate(lines):
        ok = line.finite("peak_mem_bytes")
        fig.add_scatter(
            x=line.steps[ok], y=line.values["peak_mem_bytes"][ok] / unit, mode="lines",
            name=label(line.label), line={"color": colour(i), "width": 1.4},
            hovertemplate=f"step %{{x}}<br>%{{y:.4g}} {unit_name}<extra>%{{fullData.name}}"
            "</extra>",
        )
    fig.update_yaxes(title={"text": f"peak memory ({unit_name})"}, rangemode="tozero")
    _legend_if_many(fig, lines)
    return fig


def skip_rate_figure(lines: list[StepColumns], totals: list[int],
                     windows: int = 100) -> go.Figure:
    """Share of skipped steps per window of steps, in percent.

    Exact on downsampled lines: downsampling keeps every skipped step, and steps count
    skipped ones, so a window's size is its step span. `totals[i]`: steps of line i.
    """
    fig = base_figure()
    drawn = False
    for i, (line, total) in enumerate(zip(lines, totals, strict=True)):
        if not len(line) or not total:
            continue
        first, last = int(line.steps.min()), int(line.steps.max())
        edges = np.unique(np.linspace(first, last + 1, min(windows, last + 1 - first) + 1)
                          .round().astype(np.int64))
        skipped, _ = np.histogram(line.steps[line.skipped], bins=edges)
        rate = 100.0 * skipped / np.diff(edges)
        fig.add_scatter(
            x=edges[:-1], y=rate, customdata=np.stack([edges[1:] - 1, skipped], axis=-1),
            mode="lines", line={"color": colour(i), "width": 1.4, "shape": "hv"},
            name=label(line.label),
            hovertemplate="steps %{x}-%{customdata[0]}<br>%{customdata[1]} skipped "
            "(%{y:.2f}%)<extra>%{fullData.name}</extra>",
        )
        drawn = True
    if not drawn:
        return note(fig, "no steps yet")
    fig.update_yaxes(title={"text": "skipped steps (%)"}, rangemode="tozero")
    _legend_if_many(fig, lines)
    return fig


def step_time_figure(lines: list[StepColumns]) -> go.Figure:
    """Total step time per line (several runs overlaid)."""
    fig = base_figure()
    drawn = False
    for i, line in enumerate(lines):
        total = step_time(line)
        ok = np.isfinite(total)
        if not ok.any():
            continue
        drawn = True
        fig.add_scatter(
            x=line.steps[ok], y=total[ok], mode="lines", name=label(line.label),
            line={"color": colour(i), "width": 1.4},
            hovertemplate="step %{x}<br>%{y:.3g} ms<extra>%{fullData.name}</extra>",
        )
    if not drawn:
        return note(fig, "no step timings recorded")
    fig.update_yaxes(title={"text": "step time (ms)"}, rangemode="tozero")
    _legend_if_many(fig, lines)
    return fig
