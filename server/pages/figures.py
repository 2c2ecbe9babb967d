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
WARNING = "#b45309"
HEALTHY = "#137333"
MUTED = "#5f6368"
GRID = "#eceff1"
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
LINE_COLOURS = ("#1a73e8", "#12a4af", "#9334e6", "#e8710a", "#3c4043", "#0b8043",
                "#b0630b", "#6b5bd2")
PHASE_COLOURS = {"t_forward_ms": "#1a73e8", "t_backward_ms": "#12a4af",
                 "t_optimizer_ms": "#9334e6"}
PHASE_NAMES = {"t_forward_ms": "forward", "t_backward_ms": "backward",
               "t_optimizer_ms": "optimizer"}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
CHART_HEIGHT = 260
SCALE_FLOOR = -24  # log2: a loss scale below 2^-24 is collapsed, whatever its value


def label(text: str) -> str:
    """A client-sent name made safe for Plotly's HTML-ish text rendering."""
    return html.escape(text, quote=False)


def colour(i: int) -> str:
    return LINE_COLOURS[i % len(LINE_COLOURS)]


def base_figure(height: int = CHART_HEIGHT, *, x_title: str = "step",
                hovermode: str = "x unified") -> go.Figure:
    """An empty figure in the dashboard's style; `uirevision` keeps zoom across updates.
    Step charts hover every line at the step under the mouse ("x unified"): nobody has
    to hit a line; heatmaps and bars pass "closest"."""
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
        # top left: the toolbar Plotly shows on hover sits top right
        "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0,
                   "yanchor": "bottom", "bgcolor": "rgba(255,255,255,0)"},
        "hovermode": hovermode,
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


def _nonfinite_markers(fig: go.Figure, line: StepColumns, name: str, top: float, *,
                       several: bool = False) -> None:
    """Red triangles along the top edge at steps whose value was NaN or infinite; with
    `several` lines (runs on /compare), named by their line."""
    bad = line.nonfinite(name)
    if not bad.any():
        return
    values = line.values[name][bad]
    text = np.where(np.isnan(values), "NaN", np.where(values > 0, "+inf", "-inf"))
    title = f"{label(line.label)}: non-finite" if several else "non-finite"
    fig.add_scatter(
        x=line.steps[bad], y=np.full(int(bad.sum()), top), mode="markers",
        marker={"symbol": "triangle-down", "size": 9, "color": CRITICAL},
        name=title, legendgroup=title,
        showlegend=not any(t.legendgroup == title for t in fig.data),
        text=text, hovertemplate="step %{x}: %{text}<extra>" + label(line.label) + "</extra>",
    )


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


def _spans(fig: go.Figure, spans: list[tuple[int, int]], low: float, high: float, *,
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
        showlegend=not any(t.legendgroup == legend for t in fig.data),
    )
    steps = np.concatenate([np.arange(a, b + 1) for a, b in spans])
    bounds = np.concatenate([np.tile([a, b, b - a + 1], (b - a + 1, 1)) for a, b in spans])
    fig.add_scatter(
        x=steps, y=np.full(steps.size, high), customdata=bounds, mode="markers",
        marker={"opacity": 0, "size": 1}, name=title, legendgroup=legend, showlegend=False,
        hovertemplate="skipped: steps %{customdata[0]}-%{customdata[1]} "
                      "(%{customdata[2]:,} in this span)",
    )


def loss_scale_figure(lines: list[StepColumns]) -> go.Figure:
    """Loss scale on a log2 axis (ticks at whole powers of two), skipped steps shaded as
    spans (hovering one names its run and its first and last step); the x axis spans
    every step. A scale that collapsed does not stretch the axis to 2^-149: scales under
    2^SCALE_FLOOR and a scale of 0 are drawn on one row below it, labelled, with the
    step it fell at."""
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
                hovertemplate="scale %{customdata:.6g}",
            )
        drawn.append((i, line, fallen))
    if not drawn:
        return note(fig, "no loss scale recorded (no GradScaler in this run)")
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
                      annotation_text="scale 1", annotation_font_color=CRITICAL,
                      annotation_position="bottom right")
    share_x(fig, step_span(lines))
    _legend_if_many(fig, lines)
    return fig


def _fallen(fig: go.Figure, line: StepColumns, fallen: np.ndarray, row: float, *,
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


def step_span(lines: list[StepColumns]) -> tuple[int, int] | None:
    """First and last step over every line (whatever each line's values)."""
    spans = [(int(line.steps.min()), int(line.steps.max())) for line in lines if len(line)]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def step_span_of(step_arrays: list[np.ndarray]) -> tuple[int, int] | None:
    """First and last step over arrays of steps (empty ones ignored)."""
    spans = [(int(a.min()), int(a.max())) for a in step_arrays if a.size]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def mark_step(fig: go.Figure, step: int | None) -> go.Figure:
    """A vertical line at `step` (the step a link from a problem opened the page at)."""
    if step is not None and fig.layout.xaxis.visible is not False:
        fig.add_vline(x=step, line={"color": CRITICAL, "width": 1.5, "dash": "dash"},
                      annotation_text=f"step {step:,}", annotation_position="top",
                      annotation_font_color=CRITICAL, name="mark")
    return fig


def share_x(fig: go.Figure, x_range: tuple[int, int] | None) -> go.Figure:
    """One x range for every chart of a page: from its first step to its last, so charts
    line up and none stops short where its values end (a scale of 0, a NaN loss)."""
    if x_range is not None:
        first, last = x_range
        fig.update_xaxes(range=[first - 0.5, last + 0.5] if last > first else
                         [first - 1, last + 1])
    return fig


def human_number(value: float) -> str:
    """A tick label as a person writes it: 0.002, 50, 1e-5, 2e+6 (no float noise)."""
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.6g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def log10_ticks(low: float, high: float) -> list[float]:
    """Ticks for a log axis over [low, high] (values > 0): 1-2-5 steps over a short range,
    whole decades (every n-th when many) over a long one."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    if last - first <= 2:
        ticks = [m * 10.0 ** k for k in range(first, last + 1) for m in (1, 2, 5)]
    else:
        stride = max(1, math.ceil((last - first) / 6))
        ticks = [10.0 ** k for k in range(first, last + 1, stride)]
    inside = [t for t in ticks if low <= t * (1 + 1e-9) and t <= high * (1 + 1e-9)]
    return inside if len(inside) >= 2 else ticks


def grad_norm_figure(lines: list[StepColumns]) -> go.Figure:
    """Total grad norm on a log axis with ticks as a person writes them; NaN/inf steps as
    red markers along the top."""
    fig = base_figure()
    positive = [line.values["grad_norm"][line.finite("grad_norm") & (line.values["grad_norm"] > 0)]
                for line in lines]
    positive = [p for p in positive if p.size]
    low = min((float(p.min()) for p in positive), default=0.1)
    high = max((float(p.max()) for p in positive), default=1.0)
    top = high * 4
    for i, line in enumerate(lines):
        norm = line.values["grad_norm"]
        ok = np.isfinite(norm) & (norm > 0)
        fig.add_scatter(
            x=line.steps[ok], y=norm[ok], mode="lines", name=label(line.label),
            line={"color": colour(i), "width": 1.4},
            hovertemplate="step %{x}<br>grad norm %{y:.4g}<extra>%{fullData.name}</extra>",
        )
        _nonfinite_markers(fig, line, "grad_norm", top, several=len(lines) > 1)
    if not any(line.present["grad_norm"].any() for line in lines):
        return note(fig, "no grad norm recorded")
    ticks = log10_ticks(low, top)
    fig.update_yaxes(type="log", title={"text": "grad norm"}, tickvals=ticks,
                     ticktext=[human_number(t) for t in ticks],
                     range=[math.log10(low) - 0.1, math.log10(top) + 0.1])
    share_x(fig, step_span(lines))
    _legend_if_many(fig, lines)
    return fig


LOSS_SMOOTHING = 0.6  # the EMA weight the loss is first drawn with; app.js's slider changes it


def smooth(values: np.ndarray, weight: float = LOSS_SMOOTHING) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing) of finite values;
    app.js computes the same when the page's slider moves."""
    out = np.empty(values.shape)
    last, debias = 0.0, 0.0
    for i, value in enumerate(values.tolist()):
        last = last * weight + (1 - weight) * value
        debias = debias * weight + (1 - weight)
        out[i] = last / debias
    return out


def loss_figure(lines: list[StepColumns]) -> go.Figure:
    """Training loss, each line smoothed (EMA, LOSS_SMOOTHING) over its raw values drawn
    faint (app.js: a smoothing slider and a log toggle); NaN/inf steps as red markers
    along the top."""
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
        name = label(line.label)
        fig.add_scatter(
            x=line.steps[ok], y=line.values["loss"][ok], mode="lines", name=name,
            line={"color": colour(i), "width": 1}, opacity=0.3, legendgroup=name,
            showlegend=False, meta="loss-raw", hoverinfo="skip",
        )
        fig.add_scatter(
            x=line.steps[ok], y=smooth(line.values["loss"][ok]), mode="lines", name=name,
            line={"color": colour(i), "width": 1.6}, legendgroup=name, meta="loss-smooth",
            customdata=line.values["loss"][ok],
            hovertemplate="loss %{customdata:.5g} (smoothed %{y:.5g})",
        )
        _nonfinite_markers(fig, line, "loss", top, several=len(lines) > 1)
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


def dash_lines(fig: go.Figure, labels: list[str]) -> go.Figure:
    """Each line its own dash style (line i gets DASHES[i]) so that lines drawn on top of
    each other stay told apart."""
    dash = {label(name): DASHES[i % len(DASHES)] for i, name in enumerate(labels)}
    for trace in fig.data:
        if trace.type == "scatter" and trace.name in dash and trace.mode == "lines" \
                and trace.fill in (None, "none"):
            trace.line.dash = dash[trace.name]
    return fig
