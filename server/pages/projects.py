"""/projects/{project}: every run of a project with its outcome, the settings that
separate the runs that went bad (server/services/projects.py), and one chart per top
setting: each run's outcome and first bad step against its value of that setting."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from ampwatch.server.pages.figures import CRITICAL, HEALTHY, MUTED, WARNING, base_figure, label
from ampwatch.server.pages.plot import Figure
from ampwatch.server.services.projects import project_tags, read_project

CHARTED = 3  # the top settings drawn
LOG_SPAN = 100  # positive values spanning this factor or more get a log axis (an lr sweep)
CHART_HEIGHT = 300
OUTCOME_MARKERS = (("critical", CRITICAL, "circle"), ("warning", WARNING, "diamond"),
                   ("healthy", HEALTHY, "circle-open"))


def project_twin(session: Session, project: str, *, tag: str | None) -> dict:
    """The page as JSON: the API's answer (`runs`, `factors`), the project's tags, and
    for each charted setting its value in every run (`charts`, in `runs` order)."""
    view = read_project(session, project, tag=tag)
    charted = [f for f in view.health.factors if f.credited and f.kind != "constant"]
    return {**view.health.model_dump(mode="json"), "tags": project_tags(session, project),
            "charts": [{"key": f.key, "values": view.values(f.key)}
                       for f in charted[:CHARTED]]}


def project_figures(twin: dict) -> dict[str, Figure]:
    """One figure per charted setting, named chart-0, chart-1, ..."""
    factors = {f["key"]: f for f in twin["factors"]}
    return {f"chart-{i}": factor_figure(factors[chart["key"]], twin["runs"], chart["values"])
            for i, chart in enumerate(twin["charts"])}


def factor_figure(factor: dict, runs: list[dict], values: list[Any]) -> Figure:
    """Each run with data as one point: x its value of the setting, y the first step of
    its first problem (a healthy run: hollow, at the steps it ran), coloured by outcome;
    a numeric split's threshold as a dashed line."""
    key = factor["key"]
    fig = base_figure(CHART_HEIGHT, x_title=label(key), hovermode="closest")
    numeric = factor["kind"] == "numeric"
    shown = [(run, value) for run, value in zip(runs, values, strict=True)
             if run["outcome"] != "no_data" and (value is not None or not numeric)]
    for outcome, colour, symbol in OUTCOME_MARKERS:
        points = [(run, value) for run, value in shown if run["outcome"] == outcome]
        if not points:
            continue
        healthy = outcome == "healthy"
        fig.add_scatter(
            x=[value if numeric else _category(value) for _, value in points],
            y=[run["steps"] if healthy else run["first_bad_step"] for run, _ in points],
            mode="markers", name=f"{outcome} ({len(points)})",
            marker={"color": colour, "symbol": symbol, "size": 9,
                    "line": {"width": 1.5, "color": colour}},
            text=[_hover(run, key, value) for run, value in points], hoverinfo="text")
    fig.update_layout(showlegend=True, margin={"t": 36})
    fig.update_yaxes(title={"text": "first bad step · healthy: steps run", "standoff": 4},
                     rangemode="tozero")
    if numeric:
        present = [v for _, v in shown if v is not None]
        if present and min(present) > 0 and max(present) / min(present) >= LOG_SPAN:
            fig.update_xaxes(type="log")
        if factor["threshold"] is not None:
            _threshold_line(fig, key, factor["threshold"], present)
    else:
        order = [*factor["values"], *(["not set"] if any(v is None for _, v in shown) else [])]
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    return fig


def _threshold_line(fig: Figure, key: str, at: float, present: list[float]) -> None:
    """A dashed line between the split's sides (midway to the largest value below the
    threshold; geometric on a log axis), labelled with the split."""
    log = fig.layout["xaxis"].get("type") == "log"
    below = max((v for v in present if v < at), default=at)
    x = math.sqrt(at * below) if log else (at + below) / 2
    fig.layout.setdefault("shapes", []).append(
        {"type": "line", "x0": x, "x1": x, "xref": "x", "y0": 0, "y1": 1, "yref": "y domain",
         "line": {"color": MUTED, "dash": "dash", "width": 1}})
    # an annotation on a log axis is placed by the log of its x; a shape by x itself
    fig.add_annotation(x=math.log10(x) if log else x, xref="x", y=1, yref="y domain",
                       yanchor="bottom", showarrow=False, text=label(f"{key} >= {at:g}"),
                       font={"color": MUTED, "size": 11})


def _category(value: Any) -> str:
    return "not set" if value is None else str(value)


def _hover(run: dict, key: str, value: Any) -> str:
    what = (f"healthy for {run['steps']:,} steps" if run["outcome"] == "healthy"
            else f"{run['outcome']} from step {run['first_bad_step']}")
    kinds = f"<br>{label(', '.join(run['kinds']))}" if run["kinds"] else ""
    return f"{label(run['name'])}<br>{label(key)} = {label(_category(value))}<br>{what}{kinds}"
