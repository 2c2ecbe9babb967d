"""The step charts' x-axis choices: steps, relative time or wall time.

No step carries a timestamp; each carries `t_step_ms`, the time from the end of the
previous optimizer step to the end of its own, so a line's clock is the running sum of
it (`series.with_elapsed`): zero at the end of its first stored step, pauses between
steps (evals, checkpoints) included. Wall time puts that zero at the run's registration
(`created_at`). Figures are built on steps and moved onto time afterwards (`retime`), so
every builder stays a function of steps.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import numpy as np

from ampwatch.server.pages.columns import StepColumns
from ampwatch.server.pages.figures import label
from ampwatch.server.pages.plot import Figure

XAxis = Literal["step", "relative", "wall"]
X_AXES: dict[str, str] = {"step": "step", "relative": "relative time",
                          "wall": "wall time (UTC)"}
# the relative axis's unit: the largest whose count of the longest line stays readable
UNITS = (("h", 3_600_000.0, 10 * 3_600_000.0), ("min", 60_000.0, 10 * 60_000.0),
         ("s", 1000.0, 0.0))


def relative_unit(lines: list[StepColumns]) -> tuple[str, float]:
    """(name, milliseconds) of the relative axis's unit: seconds up to 10 minutes,
    minutes up to 10 hours, hours beyond."""
    longest = max((float(np.nanmax(line.values["elapsed_ms"])) for line in lines
                   if line.present["elapsed_ms"].any()), default=0.0)
    return next((name, ms) for name, ms, above in UNITS if longest >= above)


def retime(fig: Figure, axis: XAxis, lines: list[StepColumns],
           started: list[datetime]) -> Figure:
    """`fig`, built on steps from `lines`, with every x (traces, marks, the shared range)
    moved to `axis`: each trace on the clock of the line whose label names it (the
    first line's otherwise); steps between two recorded ones are interpolated.
    `started`: each line's run's registration (the wall clock's zero). A trace of a
    line with no clock (its steps are gone) is left out."""
    if axis == "step" or not lines or fig.layout["xaxis"].get("visible") is False:
        return fig
    unit, per = relative_unit(lines)
    clocks = []
    for line, start in zip(lines, started, strict=True):
        have = line.present["elapsed_ms"]
        offset = start.timestamp() * 1000.0 if axis == "wall" else 0.0
        scale = 1.0 if axis == "wall" else per
        clocks.append((line.steps[have], (line.values["elapsed_ms"][have] + offset) / scale))

    def owner(name: str | None) -> tuple[np.ndarray, np.ndarray]:
        for line, clock in zip(lines, clocks, strict=True):
            if name == label(line.label) or (name or "").startswith(label(line.label) + ": "):
                return clock
        return clocks[0]

    def moved(steps: list | np.ndarray, clock: tuple[np.ndarray, np.ndarray]) -> list:
        at = np.array([np.nan if s is None else s for s in steps], dtype=np.float64)
        x = np.interp(at, *clock) if clock[0].size else np.full(at.shape, np.nan)
        return [None if np.isnan(v) else float(v) for v in x.tolist()]

    kept = []
    for trace in fig.data:
        clock = owner(trace.get("name"))
        if not clock[0].size:
            continue
        steps = trace["x"]
        trace["x"] = moved(steps, clock)
        if "text" not in trace:  # the hover still names the step
            trace["text"] = [None if s is None else f"{int(s):,}" for s in steps]
            if "hovertemplate" in trace:
                trace["hovertemplate"] = trace["hovertemplate"].replace("%{x}", "%{text}")
        kept.append(trace)
    fig.data = kept
    for mark in (*fig.layout.get("shapes", ()), *fig.layout.get("annotations", ())):
        if mark.get("xref", "x") == "x":
            clock = owner(mark.get("text"))
            for key in ("x", "x0", "x1"):
                if key in mark:
                    mark[key] = moved([mark[key]], clock)[0]
    xaxis = fig.layout["xaxis"]
    ends = [x for _, x in clocks if x.size]
    if "range" in xaxis and ends:
        xaxis["range"] = [min(float(x[0]) for x in ends), max(float(x[-1]) for x in ends)]
    xaxis["title"] = {**xaxis.get("title", {}), "text": X_AXES[axis] if axis == "wall"
                      else f"{X_AXES[axis]} ({unit})"}
    if axis == "wall":
        xaxis["type"] = "date"  # x in milliseconds since the epoch, drawn in UTC
    return fig
