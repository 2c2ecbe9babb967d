"""/runs/{id}/fp8: the FP8 tab (shown for runs with FP8 layers): per (layer, tensor) the
shares of elements saturated and flushed to zero over steps, and each FP8 layer's recipe,
formats and latest scale. Figure builders are pure `twin -> Figure` functions."""

from __future__ import annotations

import numpy as np
from plotly.colors import get_colorscale
from sqlalchemy.orm import Session

from ampwatch.server.pages import views
from ampwatch.server.pages.figures import base_figure, label, note
from ampwatch.server.pages.heatmaps import heatmap_height
from ampwatch.server.pages.plot import Figure
from ampwatch.server.services.fp8 import fp8_twin
from ampwatch.server.settings import Settings

BUCKETS = 1000
# Plotly's ColorBrewer scales as stops: plotly.js's own "Blues" and "Reds" are others
SHARE_COLOURS = {"underflow": get_colorscale("Blues"), "saturated": get_colorscale("Reds")}


def fp8_page_twin(session: Session, settings: Settings, run_id: str, *, rank: int,
                  steps: views.StepRange) -> dict:
    """The FP8 tab's twin: the run, and its FP8 report for `rank` over `steps`."""
    return {"run": views.page_run(session, run_id, settings),
            **fp8_twin(session, run_id, rank=rank, buckets=BUCKETS, **steps.query())}


def share_heatmap(twin: dict, name: str, what: str) -> Figure:
    """(layer · tensor) rows x step buckets of the largest share of `name` per bucket;
    blank where a bucket has no sample, zero shares in the scale's lightest colour."""
    fig = base_figure(heatmap_height(len(twin["rows"])), hovermode="closest")
    if not twin["samples"] or not twin["rows"]:
        return note(fig, "the FP8 samples were archived with the run's steps"
                    if twin["run"]["archived_at"] else "no FP8 samples recorded yet")
    z = np.array([[np.nan if v is None else v for v in row] for row in twin[name]],
                 dtype=np.float64) * 100
    fig.add_heatmap(
        x=twin["steps"], y=[label(r) for r in twin["rows"]], z=z, zmin=0,
        zmax=max(1.0, float(np.nanmax(z)) if np.isfinite(z).any() else 1.0),
        colorscale=SHARE_COLOURS[name], name=what,
        colorbar={"title": {"text": "% of elements", "side": "right"}, "thickness": 12},
        hovertemplate="%{y}<br>steps from %{x}<br>" + what + ": %{z:.3g}%<extra></extra>",
    )
    fig.update_yaxes(autorange="reversed", showgrid=False, type="category")
    fig.update_xaxes(showgrid=False)
    fig.update_layout(plot_bgcolor="#f1f3f4", margin={"l": 8})
    return fig


def fp8_figures(twin: dict) -> dict[str, Figure]:
    return {"fp8_underflow": share_heatmap(twin, "underflow", "flushed to zero"),
            "fp8_saturated": share_heatmap(twin, "saturated", "clipped at the max")}
