"""The phases chart draws what wire/steps.py charts as "phases", declared there once: a
timing added with chart="phases" is stacked without editing the figure."""

from __future__ import annotations

from ampwatch.server.pages import figures
from ampwatch.server.pages.columns import StepColumns
from ampwatch.wire.steps import STEP_FIELDS


def test_every_phase_field_is_stacked_and_the_total_is_not():
    charted = {f.name for f in STEP_FIELDS if f.chart == "phases"}
    assert set(figures.PHASE_NAMES) == charted - {figures.STEP_TOTAL}
    assert set(figures.PHASE_COLOURS) == set(figures.PHASE_NAMES)


def test_the_figure_draws_one_stacked_line_per_declared_phase():
    items = [{"step": s, **{name: 1.0 + s for name in figures.PHASE_NAMES}} for s in range(4)]
    fig = figures.phase_times_figure([StepColumns.from_items("rank 0", items)])
    drawn = [trace["name"] for trace in fig.data]
    assert drawn == list(figures.PHASE_NAMES.values())
