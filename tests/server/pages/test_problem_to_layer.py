"""From a problem to its step and its layer (issue #35, point 5), on the growing-layer
fp16 run: a step link opens a window centred on the step with a line there on every
chart, a range link stays inside the run, and the layer link, a heatmap row and the
tables open the layer's own view (an FP8 layer's with what its casts lost);
nn.Sequential layers are named with their type."""

from __future__ import annotations

import math
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest

from ampwatch.server.store.fp8_samples import ROLES, STATS
from tests.server.pages.conftest import GROWING_LAYER
from tests.server.test_fp8_samples import send

pytestmark = pytest.mark.browser
STEP_CHARTS = ("loss_scale", "grad_norm", "loss", "lr", "phases")


def _layer_path(server_url: str, name: str) -> str:
    """The layer view's path of the layer named `name` (its index from the layer table)."""
    layers = httpx.get(f"{server_url}/api/v1/runs/growing-fp16/layers", timeout=10).json()
    index = next(item["index"] for item in layers["items"] if item["name"] == name)
    return f"/runs/growing-fp16/layers/{index}"


def _query(url: str) -> dict[str, int]:
    return {k: int(v[0]) for k, v in parse_qs(urlsplit(url).query).items() if v[0].isdigit()}


def _vlines(browser, name: str) -> list[float]:
    return browser.page.evaluate(
        """(id) => (document.getElementById(id).layout.shapes || [])
            .filter(s => s.type === 'line' && s.x0 === s.x1).map(s => s.x0)""", f"fig-{name}")


def test_a_step_link_centres_the_window_and_marks_the_step(field_browser, field_runs):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    card = browser.page.locator("#problems .finding").first
    link = card.locator("a.step-link")
    first = field_runs.first_overflow
    window = _query(link.get_attribute("href"))
    assert window["end"] <= field_runs.steps - 1  # a range never runs past the run's end
    timeline = card.locator("a.tl-step")
    steps = [int(t.replace(",", "").split()[-1]) for t in timeline.all_inner_texts()]
    assert steps, "the card has no timeline"
    at = steps[0]
    with browser.page.expect_navigation():
        timeline.first.click()
    query = _query(browser.page.url)
    assert query["mark"] == at
    assert query["start"] <= at <= query["end"]
    if at - 100 >= 0 and at + 100 <= field_runs.steps - 1:
        assert query["start"] + query["end"] == 2 * at  # centred
    browser.wait_for_plots(*STEP_CHARTS)
    for name in STEP_CHARTS:
        assert _vlines(browser, name) == [at], name
    assert first >= at - 400  # the overflow the test's hook saw is inside the story
    browser.assert_clean()


def test_the_layer_link_opens_the_layers_own_view(field_browser, field_runs):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    card = browser.page.locator("#problems .finding", has_text=f"Layer '{GROWING_LAYER}'").first
    with browser.page.expect_navigation():
        card.locator("a.layer-link").click()
    assert urlsplit(browser.page.url).path == _layer_path(field_runs.server.url, GROWING_LAYER)
    assert browser.page.locator("#layer-title").inner_text() == \
        f"Layer {GROWING_LAYER} · Linear(64, 64)"
    browser.wait_for_plots("layer_grad", "layer_act", "layer_zero")
    act = browser.page.evaluate("document.getElementById('fig-layer_act')._fullData"
                                ".map(t => [t.name, t.x.length])")
    assert dict(act)["abs-max"] > 20  # sampled every 5 steps (and every step after an anomaly)
    assert "fp16 max 65504" in str(browser.page.evaluate(
        "document.getElementById('fig-layer_act').layout.annotations.map(a => a.text)"))
    mark = _query(browser.page.url)["mark"]
    assert _vlines(browser, "layer_act") == [mark]
    assert "overflow" in browser.page.locator("#layer-findings").inner_text()
    browser.shoot("layer-view")
    browser.assert_clean()


def test_heatmap_rows_and_tables_open_the_layer_view(field_browser, field_runs):
    browser = field_browser
    path = _layer_path(field_runs.server.url, GROWING_LAYER)
    browser.goto("/runs/growing-fp16/layers")
    browser.wait_for_plots("grad_heatmap")
    ticks = browser.page.locator("#fig-grad_heatmap .ytick text").evaluate_all(
        "texts => texts.map(t => t.textContent)")
    assert "6 · Linear(64, 64)" in ticks and "10 · Linear(64, 16)" in ticks
    assert browser.page.locator("#precision a.layer-view", has_text="6").first \
        .get_attribute("href").startswith(path + "?")
    box = browser.page.locator("#fig-grad_heatmap .ytick", has_text="6 · Linear").bounding_box()
    plot = browser.page.locator("#fig-grad_heatmap .nsewdrag").bounding_box()
    with browser.page.expect_navigation():
        browser.page.mouse.click(plot["x"] + plot["width"] / 2, box["y"] + box["height"] / 2)
    assert urlsplit(browser.page.url).path == path
    browser.assert_clean()


def test_an_fp8_layers_view_shows_what_its_casts_lost(field_browser, field_runs):
    browser = field_browser
    # FP8 statistics need a GPU to record: these are wire batches of what they hold
    with httpx.Client(base_url=field_runs.server.url, timeout=30) as api:
        sent = send(api, "fp8-wire", n_layers=4, fp8_every=2, steps=range(60))
    browser.goto("/runs/fp8-wire/layers/2")
    browser.wait_for_plots("layer_fp8")
    drawn = {t["name"]: t for t in browser.traces("layer_fp8")}
    assert set(drawn) == {f"{role} {what}" for role in ("input", "weight", "grad")
                          for what in ("flushed", "saturated")}
    shown = browser.page.evaluate("""() => Math.max(...document.getElementById('fig-layer_fp8')
        ._fullData.filter(t => t.name === 'input flushed')[0].y)""")
    truth = 100 * float(np.nanmax(sent[:, ROLES.index("input"), STATS.index("underflow"), 2]))
    assert math.isclose(shown, truth, rel_tol=1e-5)
    browser.assert_clean()


def test_a_keyboard_reaches_a_heatmap_rows_layer_view(field_browser, field_runs):
    browser = field_browser
    path = _layer_path(field_runs.server.url, GROWING_LAYER)
    browser.goto("/runs/growing-fp16/layers")
    browser.wait_for_plots("grad_heatmap")
    label = browser.page.locator("#fig-grad_heatmap .ytick text[role=link]",
                                 has_text="6 · Linear(64, 64)")
    label.focus()  # reached by Tab: it is in the tab order
    assert label.get_attribute("tabindex") == "0"
    with browser.page.expect_navigation():
        browser.page.keyboard.press("Enter")
    assert urlsplit(browser.page.url).path == path
    browser.assert_clean()
