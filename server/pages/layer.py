"""/runs/{id}/layers/{index}: one layer on its own, opened from a heatmap row, a table
or a problem card: its grad norm, its forward output's abs-max against its dtype's
maximum, its share of exactly-zero grad elements, an FP8 layer's shares of elements its
casts flushed or saturated, and the findings that name it."""

from __future__ import annotations

import math

import numpy as np
from sqlalchemy.orm import Session

from ampwatch.server.analysis.localize import DTYPE_MAX, dtype_word
from ampwatch.server.pages import figures
from ampwatch.server.pages.columns import LayerMatrix, decode_values
from ampwatch.server.pages.heatmaps import layer_title
from ampwatch.server.pages.plot import Figure
from ampwatch.server.pages.views import MAX_POINTS, StepRange, findings_of, page_run
from ampwatch.server.services.runs import get_run
from ampwatch.server.services.series import layer_series_query, layers_query, matrix_query
from ampwatch.server.settings import Settings
from ampwatch.server.store.fp8_samples import fp8_report
from ampwatch.server.store.storage import load_layers

FP8_BUCKETS = 500  # points per line of a layer's FP8 shares
EVIDENCE_BUCKETS = 500  # points per line of a layer's spike signals (sampled steps)
# the sampled signals the spike cards cite (docs/spikes.md), each drawn where the run sent it
EVIDENCE_SIGNALS = ("update_ratio", "update_lost", "adam_eps_share", "adam_v_zero_share",
                    "attn_max_logit")


def layer_twin(session: Session, settings: Settings, run_id: str, index: int, *, rank: int,
               steps: StepRange) -> dict:
    """The layer's table row, its series (downsampled to MAX_POINTS, every non-finite
    point kept) and the run's findings that name it."""
    run = get_run(session, run_id)
    series = layer_series_query(session, run, index, rank=rank, max_points=MAX_POINTS,
                                **steps.query())
    item = layers_query(session, run, rank=rank, layers=[index])["items"][0]
    findings = {status: [f for f in items if f["layer"] == item["name"]]
                for status, items in findings_of(session, run_id).items()}
    fp8 = (fp8_report(session, run_id, load_layers(session, run_id, [index]), rank,
                      buckets=FP8_BUCKETS, **steps.query())
           if (item["attrs"] or {}).get("fp8_recipe") else None)
    evidence = {signal: matrix_query(session, run, metric=signal, rank=rank,
                                     buckets=EVIDENCE_BUCKETS, layers=[index], **steps.query())
                for signal in EVIDENCE_SIGNALS}
    return {"run": page_run(session, run_id, settings), "rank": rank, "layer": item,
            "title": layer_title(item), "series": series, "findings": findings, "fp8": fp8,
            "evidence": evidence}


def _column(points: list[dict], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, values, sent) of one field of a layer series' points."""
    steps = np.array([p["step"] for p in points], dtype=np.int64)
    values, sent = decode_values([p.get(name) for p in points])
    return steps, values, sent


def _log_line(fig: Figure, steps: np.ndarray, values: np.ndarray, sent: np.ndarray,
              name: str, top: float | None = None) -> None:
    """A line on a log axis; NaN/inf points as red markers along its top (at `top`, by
    default 4x the largest finite value)."""
    ok = np.isfinite(values) & (values > 0)
    fig.add_scatter(x=steps[ok], y=values[ok], mode="lines+markers", name=name,
                    marker={"size": 3}, line={"color": figures.colour(0), "width": 1.4},
                    hovertemplate="step %{x}<br>" + name + " %{y:.4g}<extra></extra>")
    bad = sent & ~np.isfinite(values)
    if bad.any():
        if top is None:
            top = float(values[ok].max()) * 4 if ok.any() else 1.0
        text = np.where(np.isnan(values[bad]), "NaN", "inf")
        fig.add_scatter(x=steps[bad], y=np.full(int(bad.sum()), top), mode="markers",
                        marker={"symbol": "triangle-down", "size": 9, "color": figures.CRITICAL},
                        name="non-finite", text=text,
                        hovertemplate="step %{x}: %{text}<extra></extra>")
    if ok.any():  # ticks as the run page's grad norm writes them (1-2-5, never crowded)
        low, high = float(values[ok].min()), float(values[ok].max())
        ticks = figures.log10_ticks(low, high)
        fig.update_yaxes(tickvals=ticks, ticktext=[figures.human_number(t) for t in ticks])
    fig.update_yaxes(type="log", title={"text": name})


def layer_figures(twin: dict) -> dict[str, Figure]:
    """Grad norm, output abs-max (with the dtype's maximum drawn) and zero-grad share, over
    one step range."""
    series = twin["series"]
    grad = figures.base_figure()
    steps, values, sent = _column(series["grad"], "grad_norm")
    if sent.any():
        _log_line(grad, steps, values, sent, "grad norm")
    else:
        figures.note(grad, "no grad norm recorded for this layer")
    acts = figures.base_figure()
    a_steps, a_values, a_sent = _column(series["activations"], "act_absmax")
    if a_sent.any():
        dtypes = {p.get("act_dtype") for p in series["activations"]} - {None}
        finite = a_values[np.isfinite(a_values)]
        limits = [DTYPE_MAX[d] for d in dtypes & DTYPE_MAX.keys()]
        # the dtype's maximum is drawn when in view: then inf/NaN go just above it
        shown = [x for x in limits if finite.size and x / float(finite.max()) < 1e6]
        _log_line(acts, a_steps, a_values, a_sent, "abs-max",
                  top=max(shown) * 1.6 if shown else None)
        for dtype in sorted(dtypes & DTYPE_MAX.keys()):
            limit = DTYPE_MAX[dtype]
            if limit in shown:
                acts.add_hline(y=limit, line={"color": figures.CRITICAL, "dash": "dot"},
                               annotation={"text": f"{dtype_word(dtype)} max {limit:g}",
                                           "font": {"color": figures.CRITICAL}},
                               annotation_position="top left")
                acts.update_yaxes(range=[math.log10(max(float(finite.min()), 1e-30)) - 0.2,
                                         math.log10(limit) + 0.3])
    else:
        figures.note(acts, "no activation samples for this layer")
    zeros = figures.base_figure()
    z_steps, z_values, z_sent = _column(series["activations"], "grad_zero_share")
    ok = z_sent & np.isfinite(z_values)
    if ok.any():
        zeros.add_scatter(x=z_steps[ok], y=100 * z_values[ok], mode="lines+markers",
                          marker={"size": 3}, line={"color": figures.colour(1), "width": 1.4},
                          name="zero grads",
                          hovertemplate="step %{x}<br>%{y:.1f}% of grad elements exactly zero"
                          "<extra></extra>")
        zeros.update_yaxes(range=[0, 102], title={"text": "zero grad elements (%)"})
    span = figures.step_span_of([steps, a_steps])
    charts = {"layer_grad": grad, "layer_act": acts}
    if ok.any():  # bf16 runs and runs without activation samples never record it
        charts["layer_zero"] = zeros
    charts |= evidence_figures(twin["evidence"])
    if twin["fp8"] is not None:
        charts["layer_fp8"] = fp8_figure(twin["fp8"])
    return {name: figures.share_x(fig, span) for name, fig in charts.items()}


def _signal_line(matrix: dict) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a one-layer matrix's sent buckets, at each bucket's first step."""
    decoded = LayerMatrix.from_twin(matrix)
    if not decoded.layers:
        return np.zeros(0, np.int64), np.zeros(0)
    sent = ~decoded.empty[0]
    return decoded.step_start[sent], decoded.values[0][sent].astype(np.float64)


def evidence_figures(evidence: dict[str, dict]) -> dict[str, Figure]:
    """The layer's spike evidence, a chart each where the run sent it: its update/weight
    ratio (and the share of its update lost to rounding), its Adam state (shares of
    second moments under eps or zero) and, for attention, its largest logit."""
    charts = {}
    steps, ratio = _signal_line(evidence["update_ratio"])
    if steps.size:
        fig = figures.base_figure()
        _log_line(fig, steps, ratio, np.ones(steps.size, bool), "update / weight")
        charts["layer_update"] = fig
    lines = [(name, *_signal_line(evidence[signal])) for signal, name in (
        ("update_lost", "update lost to rounding"), ("adam_eps_share", "v under eps"),
        ("adam_v_zero_share", "v exactly zero"))]
    if any(steps.size for _, steps, _ in lines):
        fig = figures.base_figure()
        for i, (name, steps, share) in enumerate(lines):
            if steps.size:
                fig.add_scatter(x=steps, y=100 * share, mode="lines", name=name,
                                line={"color": figures.colour(i), "width": 1.4},
                                hovertemplate="step %{x}<br>%{y:.3g}%<extra>" + name
                                + "</extra>")
        fig.update_yaxes(title={"text": "% of elements"}, rangemode="tozero")
        fig.update_layout(showlegend=True)
        charts["layer_optimizer"] = fig
    steps, logit = _signal_line(evidence["attn_max_logit"])
    if np.isfinite(logit).any():  # a layer that is no attention sends no logit: no panel
        fig = figures.base_figure()
        fig.add_scatter(x=steps, y=logit, mode="lines", name="max logit",
                        line={"color": figures.colour(3), "width": 1.4},
                        hovertemplate="step %{x}<br>max logit %{y:.4g}<extra></extra>")
        fig.update_yaxes(title={"text": "max attention logit"})
        charts["layer_attn"] = fig
    return charts


def fp8_figure(report: dict) -> Figure:
    """An FP8 layer's casts: per tensor, the largest share of its elements flushed to zero
    (solid) and clipped at the format's maximum (dotted) per bucket of sampled steps."""
    fig = figures.base_figure()
    if not report["samples"]:
        return figures.note(fig, "no FP8 samples of this layer recorded yet")
    steps = np.asarray(report["steps"], dtype=np.int64)
    for i, row in enumerate(report["rows"]):
        tensor = row.rsplit(" · ", 1)[-1]
        for name, dash, what in (("underflow", "solid", "flushed"),
                                 ("saturated", "dot", "saturated")):
            share, sent = decode_values(report[name][i])
            fig.add_scatter(x=steps[sent], y=100 * share[sent], mode="lines",
                            name=figures.label(f"{tensor} {what}"),
                            line={"color": figures.colour(i), "dash": dash, "width": 1.4},
                            hovertemplate="%{y:.3g}%")
    fig.update_yaxes(title={"text": "% of elements"}, rangemode="tozero")
    fig.update_layout(showlegend=True)
    return fig
