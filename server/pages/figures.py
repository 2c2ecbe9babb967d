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

from ampwatch.server.pages.columns import StepColumns
from ampwatch.server.pages.plot import Figure
from ampwatch.wire.steps import STEP_FIELDS

# One meaning per colour, everywhere (server/pages/static/app.css uses the same values).
CRITICAL = "#d93025"
WARNING = "#b45309"
HEALTHY = "#137333"
MUTED = "#5f6368"
GRID = "#eceff1"
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
LINE_COLOURS = ("#1a73e8", "#12a4af", "#9334e6", "#e8710a", "#3c4043", "#0b8043",
                "#b0630b", "#6b5bd2")
STEP_TOTAL = "t_step_ms"  # on the phases chart too: the whole step, not a stacked phase
# the stacked phases, by field: whatever wire/steps.py charts as "phases" (one declaration),
# named without its t_ and _ms ("forward"), coloured in storage order
PHASE_NAMES = {f.name: f.name.removeprefix("t_").removesuffix("_ms") for f in STEP_FIELDS
               if f.chart == "phases" and f.name != STEP_TOTAL}
PHASE_COLOURS = {name: LINE_COLOURS[i % len(LINE_COLOURS)]
                 for i, name in enumerate(PHASE_NAMES)}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
CHART_HEIGHT = 260


def label(text: str) -> str:
    """A client-sent name made safe for Plotly's HTML-ish text rendering."""
    return html.escape(text, quote=False)


def colour(i: int) -> str:
    return LINE_COLOURS[i % len(LINE_COLOURS)]


def base_figure(height: int = CHART_HEIGHT, *, x_title: str = "step",
                hovermode: str = "x unified") -> Figure:
    """An empty figure in the dashboard's style; `uirevision` keeps zoom across updates.
    Step charts hover every line at the step under the mouse ("x unified"): nobody has
    to hit a line; heatmaps and bars pass "closest"."""
    axis = {"gridcolor": GRID, "zeroline": False, "linecolor": "#dadce0",
            "ticks": "outside", "tickcolor": "#dadce0", "automargin": True}
    return Figure(layout={
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


def note(fig: Figure, message: str) -> Figure:
    """A figure that says why it is empty instead of showing blank axes (`fig.empty`:
    a page may leave it out and say so once, views.left_out)."""
    fig.empty = message
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper",
                       showarrow=False, font={"color": MUTED, "size": 13})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def legend_if_many(fig: Figure, lines: list[StepColumns]) -> None:
    if len(lines) > 1 or any(trace.get("showlegend") for trace in fig.data):
        fig.update_layout(showlegend=True)


def _nonfinite_markers(fig: Figure, line: StepColumns, name: str, top: float, *,
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
        showlegend=not any(t.get("legendgroup") == title for t in fig.data),
        text=text, hovertemplate="step %{x}: %{text}<extra>" + label(line.label) + "</extra>",
    )


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


def mark_step(fig: Figure, step: int | None) -> Figure:
    """A vertical line at `step` (the step a link from a problem opened the page at)."""
    if step is not None and fig.layout["xaxis"].get("visible") is not False:
        fig.add_vline(x=step, line={"color": CRITICAL, "width": 1.5, "dash": "dash"},
                      annotation={"text": f"step {step:,}", "font": {"color": CRITICAL}},
                      annotation_position="top", name="mark")
    return fig


def share_x(fig: Figure, x_range: tuple[int, int] | None) -> Figure:
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


def grad_norm_figure(lines: list[StepColumns]) -> Figure:
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
    legend_if_many(fig, lines)
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


# The charts with a smoothing slider and a log toggle (app.js applyTools), on the run page
# and on /compare alike, and the smoothing and axis each opens on.
CHART_TOOLS = {
    "loss": {"smoothing": LOSS_SMOOTHING, "log": False},
    "grad_norm": {"smoothing": 0, "log": True},
    "phases": {"smoothing": 0, "log": False},
    "lr": {"smoothing": 0, "log": False},
    "skip_rate": {"smoothing": 0, "log": False},
    "step_time": {"smoothing": 0, "log": False},
}


def loss_figure(lines: list[StepColumns]) -> Figure:
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
    legend_if_many(fig, lines)
    return fig


def lr_figure(lines: list[StepColumns]) -> Figure:
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
    legend_if_many(fig, lines)
    return fig


def step_time(line: StepColumns) -> np.ndarray:
    """Step time in ms: `t_step_ms`, else the sum of the phases that were measured."""
    total = line.values[STEP_TOTAL].copy()
    measured = [line.present[p] & line.finite(p) for p in PHASE_NAMES]
    phases = sum((np.where(m, line.values[p], 0.0) for m, p in zip(measured, PHASE_NAMES,
                                                                    strict=True)),
                 start=np.zeros(len(line)))
    use = ~line.present[STEP_TOTAL] & np.logical_or.reduce(measured)
    total[use] = phases[use]
    return total


def phase_times_figure(lines: list[StepColumns]) -> Figure:
    """One run's forward, backward and optimizer times stacked; with several lines
    (ranks), each line's total step time."""
    fig = base_figure()
    if not any(line.present[p].any() for line in lines for p in (*PHASE_NAMES, STEP_TOTAL)):
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
        legend_if_many(fig, lines)
    fig.update_yaxes(title={"text": "time (ms)"}, rangemode="tozero")
    return fig


def _memory_unit(high: float) -> tuple[float, str]:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if high >= unit:
            return unit, name
    return 1.0, "bytes"


def peak_memory_figure(lines: list[StepColumns]) -> Figure:
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
    legend_if_many(fig, lines)
    return fig


def skip_rate_figure(lines: list[StepColumns], totals: list[int],
                     windows: int = 100) -> Figure:
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
        return note(fig, "no GradScaler or step guard: no skipped steps"
                    if any(len(line) for line in lines) else "no steps yet")
    fig.update_yaxes(title={"text": "skipped steps (%)"}, rangemode="tozero")
    legend_if_many(fig, lines)
    return fig


def step_time_figure(lines: list[StepColumns]) -> Figure:
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
    legend_if_many(fig, lines)
    return fig


def dash_lines(fig: Figure, labels: list[str]) -> Figure:
    """Each line its own dash style (line i gets DASHES[i]) so that lines drawn on top of
    each other stay told apart."""
    dash = {label(name): DASHES[i % len(DASHES)] for i, name in enumerate(labels)}
    for trace in fig.data:
        if trace["type"] == "scatter" and trace.get("name") in dash \
                and trace.get("mode") == "lines" and trace.get("fill") in (None, "none"):
            # a new dict: a builder may have passed one style dict to several traces
            trace["line"] = {**trace.get("line", {}), "dash": dash[trace["name"]]}
    return fig
