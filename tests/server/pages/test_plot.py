"""Our Figure writes the JSON plotly.graph_objects wrote for the same calls (the pages
drew through it before), but the template."""

from __future__ import annotations

import json

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.io.json import to_json_plotly

from ampwatch.server.pages.plot import Figure


def written(fig) -> dict:
    out = json.loads(to_json_plotly(fig.to_plotly_json()))
    out["layout"].pop("template", None)
    return out


@pytest.mark.parametrize(("line", "position"), [("v", "top"), ("v", "top left"),
                                                ("h", "top left"), ("h", "bottom right")])
def test_lines_and_their_labels_are_plotlys(line, position):
    ours, plotlys = Figure(), go.Figure(layout={"template": "none"})
    style = {"line": {"color": "#d93025", "dash": "dot"}, "name": "mark",
             "annotation_position": position}
    if line == "v":
        ours.add_vline(x=7, annotation={"text": "step 7", "font": {"color": "red"}}, **style)
        plotlys.add_vline(x=7, annotation_text="step 7", annotation_font_color="red", **style)
    else:
        ours.add_hline(y=2.5, annotation={"text": "max", "textangle": -90}, **style)
        plotlys.add_hline(y=2.5, annotation={"text": "max", "textangle": -90}, **style)
    assert written(ours) == written(plotlys)


def test_updates_merge_as_plotlys():
    layout = {"margin": {"l": 56, "r": 16}, "yaxis": {"range": [0, 1], "gridcolor": "#eee"},
              "xaxis": {"title": {"text": "step", "standoff": 6}}}
    ours, plotlys = Figure(layout=layout), go.Figure(layout={"template": "none", **layout})
    for fig in (ours, plotlys):
        fig.update_layout(margin={"l": 8}, showlegend=True)
        fig.update_yaxes(range=None, type="log", title={"text": "grad norm"})
        fig.update_xaxes(title={"text": "layer"}, range=[-0.5, 9.5])
        fig.add_annotation(text="none yet", x=0.5, y=0.5, xref="paper", showarrow=False)
    assert written(ours) == written(plotlys)


def test_numpy_arrays_travel_as_plotlys_typed_arrays():
    traces = {"x": np.arange(300, dtype=np.int64), "y": np.linspace(0, 1, 300),
              "text": np.array(["NaN", "+inf"] * 150), "customdata": np.ones((300, 2)),
              "name": "rank 0", "line": {"width": 1.4}}
    heatmap = {"x": np.arange(3) * 10**6, "y": ["a", "b"], "z": np.full((2, 3), np.nan,
                                                                       dtype=np.float32)}
    ours, plotlys = Figure(), go.Figure(layout={"template": "none"})
    for fig in (ours, plotlys):
        fig.add_scatter(**traces, showlegend=None)
        fig.add_heatmap(**heatmap, zmin=0)
        fig.add_bar(x=[np.int64(3)], y=[1.5])
    assert written(ours) == written(plotlys)
    assert written(ours)["data"][0]["x"]["dtype"] == "i2"  # int64 as plotly.js can read
