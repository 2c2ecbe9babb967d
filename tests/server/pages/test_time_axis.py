"""The step charts' x axis (issue #50: "an x-axis of wall time, relative time"): step,
relative time or wall time, chosen on the run page and on compare, kept in the address;
a time is the running sum of the steps' own `t_step_ms`, checked here against that sum
taken in Python from the API's steps. And compare's non-loss charts smooth and go log
like the run page's, kept in the address too."""

from __future__ import annotations

import math
from datetime import datetime
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.server.pages.conftest import Browser

pytestmark = pytest.mark.browser
RUNS = ("growing-fp16", "sgd-bf16")
COMPARE = "/compare?run=growing-fp16&run=sgd-bf16"
STEP_CHARTS = ("loss", "lr", "grad_norm", "phases")
# each plotted point: its x and the step its hover names (time_axis.retime keeps it)
POINTS = """([name, i]) => { const t = document.getElementById('fig-' + name)._fullData[i];
    return {name: t.name, x: Array.from(t.x), step: Array.from(t.text || [])}; }"""


def clock(base_url: str, run_id: str) -> tuple[dict[int, float], float]:
    """({step: ms since the end of the run's first step}, the run's registration in ms
    since the epoch), from the API: the running sum of every later step's t_step_ms."""
    with httpx.Client(base_url=base_url, timeout=30) as api:
        items = api.get(f"/api/v1/runs/{run_id}/steps", params={"rank": 0}).json()["items"]
        created = api.get(f"/api/v1/runs/{run_id}").json()["created_at"]
    elapsed, total = {}, 0.0
    for i, item in enumerate(items):
        if i and item["t_step_ms"] is not None:
            total += item["t_step_ms"]
        elapsed[item["step"]] = total
    return elapsed, datetime.fromisoformat(created).timestamp() * 1000.0


def plotted(browser: Browser, name: str, trace: int) -> tuple[str, list[tuple[int, float]]]:
    """A drawn trace's name and its (step, x) points."""
    points = browser.page.evaluate(POINTS, [name, trace])
    return points["name"], [(int(step.replace(",", "")), x)
                            for step, x in zip(points["step"], points["x"], strict=True)]


def choose_x_axis(browser: Browser, value: str) -> None:
    with browser.page.expect_navigation():
        browser.page.locator("select.x-axis").select_option(value)
    browser.page.wait_for_load_state("networkidle")


def x_title(browser: Browser, name: str) -> str:
    return browser.page.evaluate(
        f"document.getElementById('fig-{name}')._fullLayout.xaxis.title.text")


def test_run_page_charts_switch_to_relative_and_wall_time_and_keep_it(field_browser,
                                                                        field_runs):
    browser = field_browser
    elapsed, created_ms = clock(field_runs.server.url, "growing-fp16")
    assert len(set(elapsed.values())) > 100  # real, uneven step times
    browser.goto("/runs/growing-fp16?smooth_phases=0.5")
    browser.wait_for_plots(*STEP_CHARTS)
    assert browser.page.locator("select.x-axis").input_value() == "step"

    choose_x_axis(browser, "relative")
    query = parse_qs(urlsplit(browser.page.url).query)
    assert query["x"] == ["relative"] and query["smooth_phases"] == ["0.5"]
    browser.wait_for_plots(*STEP_CHARTS)
    for name in STEP_CHARTS:
        assert x_title(browser, name) == "relative time (s)", name
    _, points = plotted(browser, "grad_norm", 0)
    assert len(points) > 400
    assert all(math.isclose(x, elapsed[step] / 1000, rel_tol=1e-9, abs_tol=1e-9)
               for step, x in points)
    _, phases = plotted(browser, "phases", 0)
    assert all(math.isclose(x, elapsed[step] / 1000, rel_tol=1e-9, abs_tol=1e-9)
               for step, x in phases)
    assert points[0][1] == 0  # the clock starts at the end of the first step drawn

    browser.page.reload()  # the address keeps the choice
    browser.page.wait_for_load_state("networkidle")
    browser.wait_for_plots("grad_norm")
    assert browser.page.locator("select.x-axis").input_value() == "relative"
    assert plotted(browser, "grad_norm", 0)[1] == points

    choose_x_axis(browser, "wall")
    assert parse_qs(urlsplit(browser.page.url).query)["x"] == ["wall"]
    browser.wait_for_plots(*STEP_CHARTS)
    assert browser.page.evaluate(
        "document.getElementById('fig-loss')._fullLayout.xaxis.type") == "date"
    _, wall = plotted(browser, "grad_norm", 0)
    assert all(math.isclose(x, created_ms + elapsed[step], rel_tol=0, abs_tol=1e-3)
               for step, x in wall)

    choose_x_axis(browser, "step")
    assert "x" not in parse_qs(urlsplit(browser.page.url).query)
    browser.wait_for_plots("grad_norm")
    assert browser.x_values("grad_norm") == [step for step, _ in points]
    browser.assert_clean()


def test_compare_aligns_runs_by_their_own_relative_time(field_browser, field_runs):
    browser = field_browser
    clocks = {run_id: clock(field_runs.server.url, run_id)[0] for run_id in RUNS}
    names = {"growing fp16": "growing-fp16", "sgd lr=30 bf16": "sgd-bf16"}
    browser.goto(COMPARE)
    browser.wait_for_plots("loss", "grad_norm", "step_time")
    choose_x_axis(browser, "relative")
    assert parse_qs(urlsplit(browser.page.url).query)["run"] == list(RUNS)
    browser.wait_for_plots("loss", "grad_norm", "step_time")
    for chart in ("loss", "grad_norm", "step_time", "skip_rate", "lr", "loss_scale"):
        assert x_title(browser, chart) == "relative time (s)", chart
    checked = set()
    count = browser.page.evaluate("document.getElementById('fig-step_time')._fullData.length")
    for i in range(count):
        name, points = plotted(browser, "step_time", i)
        elapsed = clocks[names[name]]
        assert all(math.isclose(x, elapsed[step] / 1000, rel_tol=1e-9, abs_tol=1e-9)
                   for step, x in points), name
        checked.add(name)
    assert checked == set(names)
    browser.page.reload()
    browser.page.wait_for_load_state("networkidle")
    assert browser.page.locator("select.x-axis").input_value() == "relative"
    browser.assert_clean()


def test_compare_smooths_and_logs_every_chart_and_keeps_it_in_the_address(field_browser):
    browser = field_browser
    browser.goto(COMPARE)
    browser.wait_for_plots("grad_norm", "step_time", "skip_rate")
    raw = browser.lines("step_time")
    assert len(raw) == 2
    smoothed = browser.smooth("step_time", 0.8, raw)  # each run its own EMA
    browser.log_axis("step_time", True)
    assert browser.page.locator(".chart-tools[data-for='fig-grad_norm'] .log-axis").is_checked()
    browser.log_axis("grad_norm", False)
    browser.smooth("skip_rate", 0.5, browser.lines("skip_rate"))
    assert browser.page.locator(".chart-tools[data-for='fig-lr']").count() == 1
    address = browser.page.url
    query = parse_qs(urlsplit(address).query)
    assert query["smooth_step_time"] == ["0.8"] and query["log_step_time"] == ["1"]
    assert query["log_grad_norm"] == ["0"] and query["smooth_skip_rate"] == ["0.5"]

    browser.page.goto(address)  # the link opens on the same view
    browser.page.wait_for_load_state("networkidle")
    browser.wait_for_plots("grad_norm", "step_time")
    browser.page.wait_for_function(
        "document.getElementById('fig-step_time')._fullLayout.yaxis.type === 'log'")
    assert browser.page.evaluate(
        "document.getElementById('fig-grad_norm')._fullLayout.yaxis.type") == "linear"
    assert browser.lines("step_time") == smoothed
    browser.assert_clean()


@pytest.mark.parametrize("axis", ["relative", "wall"])
def test_a_zoom_on_a_time_axis_is_kept_in_the_link_as_steps(field_browser, field_runs,
                                                            axis):
    """Zoomed on a time axis, the address keeps the first and last step drawn in the
    zoomed span, so the link reopens on them (still on that axis)."""
    browser = field_browser
    elapsed, created_ms = clock(field_runs.server.url, "growing-fp16")
    browser.goto(f"/runs/growing-fp16?x={axis}")
    browser.wait_for_plots(*STEP_CHARTS)
    steps = sorted(elapsed)

    def apart(i: int) -> bool:
        """Step i is 2 ms or more from both neighbours: a date axis reads a zoom's ends in
        whole milliseconds, so a half-way end then falls in a millisecond of its own."""
        return min(elapsed[steps[i]] - elapsed[steps[i - 1]],
                   elapsed[steps[i + 1]] - elapsed[steps[i]]) >= 2.0

    low = steps[next(i for i in range(len(steps) // 4, len(steps) - 1) if apart(i))]
    high = steps[next(i for i in range(len(steps) // 2, len(steps) - 1) if apart(i))]
    # the zoom's ends, half-way between two steps' times, as the axis reads them
    scale = 1000.0 if axis == "relative" else 1.0
    offset = 0.0 if axis == "relative" else created_ms
    ends = [(offset + (elapsed[a] + elapsed[b]) / 2) / scale
            for a, b in ((steps[steps.index(low) - 1], low), (high, steps[steps.index(high) + 1]))]
    if axis == "wall":  # a date axis hands its range back as UTC date strings
        ends = browser.page.evaluate(
            "ms => ms.map(v => new Date(v).toISOString().replace('T', ' ').replace('Z', ''))",
            ends)
    browser.page.evaluate("r => Plotly.relayout('fig-grad_norm', {'xaxis.range': r})", ends)
    browser.page.wait_for_function("() => window.location.search.includes('start=')")
    query = parse_qs(urlsplit(browser.page.url).query)
    drawn = [step for step, _ in plotted(browser, "grad_norm", 0)[1]
             if low <= step <= high]
    assert query["x"] == [axis]
    assert (int(query["start"][0]), int(query["end"][0])) == (min(drawn), max(drawn))
    browser.page.reload()
    browser.page.wait_for_load_state("networkidle")
    browser.wait_for_plots("grad_norm")
    reopened = [step for step, _ in plotted(browser, "grad_norm", 0)[1]]
    assert min(reopened) >= min(drawn) and max(reopened) <= max(drawn)
    assert browser.page.locator("select.x-axis").input_value() == axis
    browser.assert_clean()
