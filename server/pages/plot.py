"""The pages' figures as the JSON plotly.js draws: traces and layout are plain dicts.

plotly.graph_objects validated every property as it was set, which was most of a run
page's time; the builders only need the JSON, so `Figure` keeps what they pass as it
is and offers the few methods they call, with Plotly's meaning. There is one x and one
y axis (no subplots). No template: plotly.js without one looks as Plotly's "none".
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Plotly's own numpy -> typed array step (go.Figure's): plotly.js gets the same arrays
from _plotly_utils.utils import to_typed_array_spec

# where add_vline / add_hline put their label, as Plotly's annotation_position does
_VLINE_LABELS = {
    "top": {"y": 1, "xanchor": "center", "yanchor": "bottom"},
    "top left": {"y": 1, "xanchor": "right", "yanchor": "top"},
}
_HLINE_LABELS = {
    "top left": {"x": 0, "xanchor": "left", "yanchor": "bottom"},
    "bottom right": {"x": 1, "xanchor": "right", "yanchor": "top"},
}


class Figure:
    """`data` (one dict a trace) and `layout` (a dict), read and written directly."""

    def __init__(self, layout: dict | None = None) -> None:
        self.data: list[dict] = []
        self.layout: dict = merge({}, layout or {})
        self.empty: str | None = None  # why it draws nothing (figures.note), not sent

    def add_scatter(self, **trace: Any) -> Figure:
        return self._add("scatter", trace)

    def add_bar(self, **trace: Any) -> Figure:
        return self._add("bar", trace)

    def add_heatmap(self, **trace: Any) -> Figure:
        return self._add("heatmap", trace)

    def _add(self, kind: str, trace: dict) -> Figure:
        self.data.append({"type": kind, **{k: v for k, v in trace.items() if v is not None}})
        return self

    def add_annotation(self, **annotation: Any) -> Figure:
        self.layout.setdefault("annotations", []).append(annotation)
        return self

    def add_vline(self, x: float, *, annotation: dict, annotation_position: str,
                  **shape: Any) -> Figure:
        """A line across the plot's height at `x`, labelled by `annotation`."""
        self.layout.setdefault("shapes", []).append(
            {"type": "line", "x0": x, "x1": x, "xref": "x", "y0": 0, "y1": 1, "yref": "y domain",
             **shape})
        return self.add_annotation(x=x, xref="x", yref="y domain", showarrow=False,
                                   **_VLINE_LABELS[annotation_position], **annotation)

    def add_hline(self, y: float, *, annotation: dict, annotation_position: str,
                  **shape: Any) -> Figure:
        """A line across the plot's width at `y`, labelled by `annotation`."""
        self.layout.setdefault("shapes", []).append(
            {"type": "line", "x0": 0, "x1": 1, "xref": "x domain", "y0": y, "y1": y, "yref": "y",
             **shape})
        return self.add_annotation(y=y, xref="x domain", yref="y", showarrow=False,
                                   **_HLINE_LABELS[annotation_position], **annotation)

    def update_layout(self, **layout: Any) -> Figure:
        merge(self.layout, layout)
        return self

    def update_xaxes(self, **axis: Any) -> Figure:
        return self.update_layout(xaxis=axis)

    def update_yaxes(self, **axis: Any) -> Figure:
        return self.update_layout(yaxis=axis)

    def to_plotly_json(self) -> dict:
        """{"data": ..., "layout": ...} with numeric numpy arrays as plotly.js typed arrays
        (base64, as Plotly sends them) and other arrays as lists: JSON that orjson writes.
        Copies the containers, not the figure's strings and numbers."""
        return {"data": _typed(self.data), "layout": _typed(self.layout)}


def merge(into: dict, update: dict) -> dict:
    """`update` merged into `into` as Plotly's update does: nested dicts merge, None
    removes a property, anything else replaces it. Returns `into`."""
    for key, value in update.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            merge(into[key], value)
        else:
            into[key] = value
    return into


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_typed(v) for v in value]
    if isinstance(value, np.ndarray):
        spec = to_typed_array_spec(value)
        return spec.tolist() if isinstance(spec, np.ndarray) else spec
    return value
