"""/compare: runs side by side, each by its lowest rank; which lines coincide, and whether
the losses need a log axis."""

from __future__ import annotations

from datetime import datetime

import numpy as np
from sqlalchemy.orm import Session

from ampwatch.server.models import Run
from ampwatch.server.pages import figures, scale_chart, time_axis
from ampwatch.server.pages.columns import StepColumns
from ampwatch.server.pages.plot import Figure
from ampwatch.server.pages.views import MAX_POINTS, left_out, precision, skips_steps
from ampwatch.server.services.runs import lead_rank, public_run
from ampwatch.server.services.series import (
    steps_query,
    with_elapsed,
    with_events,
)
from ampwatch.server.settings import Settings

MAX_COMPARED = 8


def compare_twin(session: Session, settings: Settings, run_ids: list[str],
                 x_axis: time_axis.XAxis = "step") -> dict:
    """/compare: each run's lowest rank, downsampled; unknown ids listed apart. A run's
    `ranks` holds that lead rank only (one row, whatever the number of ranks). On a time
    `x_axis`, each step also has its `elapsed_ms` (`series.with_elapsed`)."""
    runs, steps, missing = [], {}, []
    for run_id in run_ids[:MAX_COMPARED]:
        run = session.get(Run, run_id)
        if run is None:
            missing.append(run_id)
            continue
        lead_row = lead_rank(session, run_id)
        public = public_run(session, run, settings,
                            [lead_row] if lead_row else []).model_dump(mode="json")
        runs.append(public)
        steps[run_id] = steps_query(session, run, rank=lead_row.rank if lead_row else 0,
                                    max_points=MAX_POINTS)
        if x_axis != "step":
            with_elapsed(session, run, steps[run_id])
    return {"runs": runs, "steps": steps, "missing": missing}


def compare_lines(twin: dict) -> list[StepColumns]:
    """One line per compared run, labelled by its name (and id when names repeat)."""
    names = [run["name"] for run in twin["runs"]]
    return [StepColumns.from_items(run["name"] if names.count(run["name"]) == 1
                                   else f"{run['name']} ({run['id']})",
                                   with_events(twin["steps"][run["id"]]))
            for run in twin["runs"]]


COMPARED_VALUES = {"loss": ("loss",), "lr": ("lr",),
                   "loss_scale": ("loss_scale",), "grad_norm": ("grad_norm",),
                   "skip_rate": ("skipped",), "step_time": ("t_step_ms", "t_forward_ms",
                                                            "t_backward_ms", "t_optimizer_ms")}


def coinciding(lines: list[StepColumns]) -> dict[str, list[str]]:
    """Per chart, the groups of runs whose lines lie on top of each other (same steps,
    same values), as 'a and b': the page says so under the chart."""
    notes: dict[str, list[str]] = {}
    for chart, names in COMPARED_VALUES.items():
        groups: list[list[StepColumns]] = []
        for line in lines:
            if not len(line) or not any(line.present[n].any() for n in names):
                continue
            for group in groups:
                if _same_line(group[0], line, names):
                    group.append(line)
                    break
            else:
                groups.append([line])
        notes[chart] = [_and([line.label for line in group])
                        for group in groups if len(group) > 1]
    return notes


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _same_line(a: StepColumns, b: StepColumns, names: tuple[str, ...]) -> bool:
    if len(a) != len(b) or not np.array_equal(a.steps, b.steps):
        return False
    return all(np.array_equal(a.present[n], b.present[n])
               and np.allclose(a.values[n], b.values[n], rtol=1e-6, atol=0, equal_nan=True)
               for n in names)


def wide_losses(lines: list[StepColumns], ratio: float = 100.0) -> bool:
    """Whether the runs' typical losses (medians) lie `ratio` or more apart, all positive:
    on a linear axis the largest would flatten the others (compare then opens on log)."""
    medians = [float(np.median(line.values["loss"][line.finite("loss")]))
               for line in lines if line.finite("loss").any()]
    positive = all(line.values["loss"][line.finite("loss")].min() > 0
                   for line in lines if line.finite("loss").any())
    return len(medians) > 1 and positive and max(medians) >= ratio * min(medians)


def compare_figures(twin: dict, lines: list[StepColumns],
                    x_axis: time_axis.XAxis = "step") -> dict[str, Figure]:
    """The compare charts over one shared step range, each run in its own dash style,
    drawn against `x_axis` (relative time lines up runs of different step speeds)."""
    # a run without a GradScaler or the step guard skips no step by design: no flat line
    # at 0% for it
    totals = [twin["steps"][run["id"]]["total"] if skips_steps(run, [line]) else 0
              for run, line in zip(twin["runs"], lines, strict=True)]
    charts = {
        "loss": figures.loss_figure(lines),
        "lr": figures.lr_figure(lines),
        "loss_scale": scale_chart.loss_scale_figure(lines),
        "grad_norm": figures.grad_norm_figure(lines),
        "skip_rate": figures.skip_rate_figure(lines, totals),
        "step_time": figures.step_time_figure(lines),
    }
    span = figures.step_span(lines)
    labels = [line.label for line in lines]
    started = [datetime.fromisoformat(run["created_at"]) for run in twin["runs"]]
    return {name: time_axis.retime(figures.dash_lines(figures.share_x(fig, span), labels),
                                   x_axis, lines, started)
            for name, fig in charts.items()}


def compare_charts(twin: dict, lines: list[StepColumns], x_axis: time_axis.XAxis = "step",
                   ) -> tuple[dict[str, Figure], dict[str, str]]:
    """The compare charts some run has data for, and the line that says why each other is
    left out ("bf16: no loss scale")."""
    charts = compare_figures(twin, lines, x_axis)
    if not any(len(line) for line in lines):  # no run sent a step yet: a live page fills
        return charts, {}
    drawn, absent = left_out(charts)
    words = precision(twin["runs"])
    if "loss_scale" in absent:
        absent["loss_scale"] = f"{words}: no loss scale"
    if "skip_rate" in absent and words != "no GradScaler":
        absent["skip_rate"] = f"{words}: {absent['skip_rate']}"
    return drawn, absent
