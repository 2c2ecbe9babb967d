"""Pages are light on first load (issue 59): plotly.js is its cartesian partial bundle,
which holds every trace type the figure builders draw; every page still draws with no
console error, and a cold run page moves at most 700 KB, as served (gzip)."""

from __future__ import annotations

import re

import pytest

from ampwatch.server.pages.assets import PLOTLY_JS, PLOTLY_JS_VERSION
from ampwatch.server.pages.plot import Figure
from tests.server.pages.conftest import open_browser

COLD_RUN_PAGE_BYTES = 700_000
PAGES = {
    "/": None,
    "/runs/growing-fp16": "loss",
    "/runs/growing-fp16/layers": "grad_heatmap",
    "/runs/growing-fp16/layers/0": "layer_grad",
    "/runs/growing-fp16/fp8": None,
    "/compare?run=growing-fp16&run=sgd-bf16": "loss",
    "/compare?run=growing-fp16&run=sgd-bf16&x=wall": "loss",
    "/projects/pages": None,
}


def test_the_bundle_holds_every_trace_type_the_figures_draw():
    bundle = PLOTLY_JS.read_text()
    assert f"plotly.js (cartesian - minified) v{PLOTLY_JS_VERSION}" in bundle[:200]
    traces = set(re.findall(r'name:"(\w+)",basePlotModule', bundle))
    drawn = {name.removeprefix("add_") for name in dir(Figure)
             if name.startswith("add_") and name not in ("add_annotation", "add_vline",
                                                          "add_hline")}
    assert drawn == {"scatter", "bar", "heatmap"}  # a new one: check it is in the bundle
    assert drawn <= traces, drawn - traces


@pytest.mark.browser
def test_every_page_draws_with_no_console_error(field_browser):
    browser = field_browser
    for path, chart in PAGES.items():
        browser.goto(path)
        if chart is not None:
            browser.wait_for_plots(chart)
            assert browser.traces(chart), path
    assert browser.page.locator(".js-plotly-plot svg.main-svg").count() > 0  # the project's
    browser.assert_clean()


@pytest.mark.browser
def test_a_cold_run_page_moves_at_most_700_kb(chromium, field_runs, tmp_path):
    browser = open_browser(chromium, field_runs.server.url, tmp_path)
    try:
        moved = []
        browser.page.on("requestfinished", lambda request: moved.append(
            (request.url, request.sizes())))
        browser.goto("/runs/growing-fp16")
        browser.wait_for_plots("loss")
        sizes = {url: size["responseBodySize"] + size["responseHeadersSize"]
                 for url, size in moved}
        plotly = next(size for url, size in moved if "/static/plotly.min.js" in url)
        assert 400_000 < plotly["responseBodySize"] < 560_000  # gzipped, not the 1.5 MB
        assert sum(sizes.values()) <= COLD_RUN_PAGE_BYTES, sizes
        browser.assert_clean()
    finally:
        browser.page.context.close()
