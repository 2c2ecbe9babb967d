"""No control on any page sends data off the machine (issue #50, point 4): every page
answers with a Content-Security-Policy that allows this server only, renders under it
without a violation, and its charts offer no "Share chart" / Chart Studio button; a
keyboard user reaches the content through a skip link."""

from __future__ import annotations

import csv
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.server.pages.conftest import open_browser
from tests.utils import make_steps, post_batch, register_run

pytestmark = pytest.mark.browser
PAGES = {
    "/": None,
    "/runs/growing-fp16": "loss",
    "/runs/growing-fp16/layers": "grad_heatmap",
    "/runs/growing-fp16/layers/0": "layer_grad",
    "/compare?run=growing-fp16&run=sgd-bf16": "loss",
}


def test_every_page_renders_under_a_same_origin_policy_with_no_cloud_button(field_browser):
    browser = field_browser
    for path, chart in PAGES.items():
        response = browser.page.goto(browser.base_url + path)
        policy = response.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "script-src 'self';" in policy, path
        browser.page.wait_for_load_state("networkidle")
        if chart is None:
            continue
        browser.wait_for_plots(chart)
        titles = browser.page.locator(".modebar-btn").evaluate_all(
            "buttons => buttons.map(b => b.getAttribute('data-title'))")
        assert titles, path  # the toolbar is there, with zoom, pan, reset and a PNG
        assert not [t for t in titles if "share" in t.lower() or "studio" in t.lower()
                    or "plot.ly" in t.lower() or "plotly" in t.lower()], (path, titles)
        assert browser.page.locator("a[href*='plot.ly'], a[href*='plotly.com']").count() == 0
    browser.assert_clean()  # a policy violation would be a console error


def test_the_first_tab_stop_skips_to_the_content(field_browser):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    browser.wait_for_plots("loss")
    browser.page.keyboard.press("Tab")
    skip = browser.page.locator(":focus")
    assert skip.inner_text() == "Skip to content"
    assert skip.evaluate("el => el.getBoundingClientRect().top") >= 0  # shown when focused
    browser.page.keyboard.press("Enter")
    assert browser.page.evaluate("document.activeElement.id") == "main"
    browser.assert_clean()


def test_a_charts_data_downloads_as_csv_made_in_the_browser(field_browser, field_runs):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    browser.wait_for_plots("loss_scale")
    with browser.page.expect_download() as download:
        browser.page.locator("#fig-loss_scale .modebar-btn[data-title='Download data as CSV']"
                             ).click()
    assert download.value.suggested_filename == "loss_scale.csv"
    lines = Path(download.value.path()).read_text().splitlines()
    assert lines[0] == "trace,x,y"
    scale = [line.split(",") for line in lines[1:] if line.startswith("rank 0,")]
    # every step's scale as the run ran with it (log2 on the chart), the test's own truth
    assert [2 ** float(y) for _, _, y in scale] == field_runs.scales[:len(scale)]
    fallen = [line for line in lines[1:] if line.startswith("scale below 2^-24,")]
    assert len(scale) + len(fallen) == field_runs.steps  # the rest: on the row under the axis
    browser.assert_clean()


FORMULA = '=HYPERLINK("https://evil.example","x")'
MARKUP = "<img src=x onerror=alert(1)>"


def test_a_csv_holds_plain_names_and_no_formula(chromium, tmp_path):
    """Runs named like a formula and like markup, compared and downloaded as CSV: each
    name is its plain text (not `&lt;img`), and the formula is text to a spreadsheet."""
    server = LiveServer(f"sqlite:///{tmp_path / 'csv.db'}", tmp_path / "server.log")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as api:
            for run_id, name in (("formula", FORMULA), ("markup", MARKUP)):
                register_run(api, run_id, name=name)
                assert post_batch(api, run_id, 0, make_steps(0, 5, 4)).status_code == 200
        browser = open_browser(chromium, server.url, tmp_path)
        browser.goto("/compare?run=formula&run=markup")
        browser.wait_for_plots("loss")
        with browser.page.expect_download() as download:
            browser.page.locator("#fig-loss .modebar-btn[data-title='Download data as CSV']"
                                 ).click()
        rows = list(csv.reader(Path(download.value.path()).read_text().splitlines()))
        names = {row[0] for row in rows[1:]}  # the loss: each run raw and smoothed
        assert names == {f"{name} ({line})" for name in ("'" + FORMULA, MARKUP)
                         for line in ("raw", "smoothed")}, names
        browser.page.context.close()
    finally:
        server.stop()


def test_the_loss_csv_names_raw_and_smoothed_apart(field_browser, field_runs):
    """One row per step and series: the loss chart's raw and smoothed lines are two series."""
    browser = field_browser
    browser.goto("/runs/sgd-bf16")
    browser.wait_for_plots("loss")
    browser.page.locator("#fig-loss").hover()
    with browser.page.expect_download() as download:
        browser.page.locator("#fig-loss .modebar-btn[data-title='Download data as CSV']"
                             ).click()
    rows = [line.split(",") for line in
            Path(download.value.path()).read_text().splitlines()[1:]]
    by_series: dict[str, list[str]] = {}
    for name, x, _ in rows:
        by_series.setdefault(name, []).append(x)
    assert {"rank 0 (raw)", "rank 0 (smoothed)"} <= set(by_series), set(by_series)
    for name, xs in by_series.items():
        assert len(xs) == len(set(xs)), f"{name}: two rows at one step"
    assert by_series["rank 0 (raw)"] == by_series["rank 0 (smoothed)"]
    browser.assert_clean()
