"""The pages in headless Chromium against a real server holding real CPU training runs:
no console errors, nothing loaded from elsewhere, charts drawn, findings and badges
right, names escaped, live runs updating without a reload."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from tests.server.pages.conftest import XSS, XSS_LAYER, XSS_PROJECT
from tests.server.pages.training import Net, Trainer
from tests.utils import make_steps, post_batch, register_run

pytestmark = pytest.mark.browser


def test_runs_list_shows_health_badges(browser):
    browser.goto("/")
    badge = {run: browser.page.locator(f"tr[data-run-id='{run}'] .badge").inner_text()
             for run in ("healthy-fp16", "diverging-fp16", "bf16-run")}
    assert {k: v.lower() for k, v in badge.items()} == {
        "healthy-fp16": "healthy", "diverging-fp16": "critical", "bf16-run": "healthy"}
    critical = browser.page.locator("tr[data-run-id='diverging-fp16'] .badge")
    assert critical.evaluate("el => getComputedStyle(el).backgroundColor") == "rgb(217, 48, 37)"
    row = browser.page.locator("tr[data-run-id='diverging-fp16']").inner_text()
    assert "60 (100.0%)" in row  # every step skipped
    browser.shoot("runs-list")

    with browser.page.expect_navigation():
        browser.page.select_option("select[name=status]", "critical")
    assert browser.page.locator("tbody tr").count() == 1
    assert "status=critical" in browser.page.url
    browser.assert_clean()


def test_overview_draws_charts_and_the_diverging_runs_finding(browser):
    browser.goto("/runs/diverging-fp16")
    browser.wait_for_plots("loss_scale", "grad_norm", "loss", "lr", "phases")
    assert browser.page.locator("#fig-memory").count() == 0  # a CPU run: no device memory
    loss_scale = {t["name"]: t for t in browser.traces("loss_scale")}
    assert loss_scale["skipped steps"]["type"] == "scatter"  # one shaded span: 60 in a row
    # scales that fell under 2^-24 are drawn on a row of their own, under the axis
    assert loss_scale["rank 0"]["points"] + loss_scale["scale below 2^-24"]["points"] == 60
    assert "2<sup>" in str(browser.page.evaluate(
        "document.getElementById('fig-loss_scale').layout.yaxis.ticktext"))
    grad = {t["name"]: t for t in browser.traces("grad_norm")}
    assert grad["non-finite"]["points"] == 60  # marked, not dropped
    assert browser.page.locator("#fig-grad_norm .scatterlayer .trace").count() >= 1
    assert {t["name"] for t in browser.traces("phases")} == {"forward", "backward",
                                                             "optimizer"}

    critical = browser.page.locator("#findings .finding-critical").first
    assert "blocks.3.fc" in critical.locator(".message").inner_text()
    layer_link = critical.locator("a.layer-link")
    assert layer_link.inner_text() == "blocks.3.fc"
    assert "/runs/diverging-fp16/layers" in layer_link.get_attribute("href")
    assert "step " in critical.locator("a.step-link").inner_text()
    assert "float16" in browser.page.locator("#environment").inner_text()
    browser.shoot("run-overview")

    with browser.page.expect_navigation():
        layer_link.click()
    assert "/layers" in browser.page.url
    browser.assert_clean()


def test_layers_page_marks_the_first_offender(browser):
    browser.goto("/runs/diverging-fp16/layers")
    browser.wait_for_plots("grad_heatmap", "act_heatmap", "fwd_time")
    acts = {t["name"]: t for t in browser.traces("act_heatmap")}
    assert acts["abs-max"]["type"] == "heatmap"
    assert "inf" in acts or "NaN" in acts
    assert "first offender" in acts
    offender = browser.page.evaluate(
        "document.getElementById('fig-act_heatmap').layout.annotations[0].text")
    assert offender == "first offender: blocks.3.fc"
    assert browser.page.locator("#fig-act_heatmap .heatmaplayer").count() == 1

    misaligned = browser.page.locator("#misaligned tbody tr")
    assert misaligned.count() == 10  # in/out of 4 blocks, embed out, head in
    assert "104" in misaligned.first.inner_text()
    norm = browser.page.locator("#precision tr[id='layer-norm']").inner_text()
    assert "float16" in norm and "fp16 sensitive" in norm
    assert {t["name"] for t in browser.traces("fwd_time")} == {"float16"}
    browser.shoot("run-layers")
    browser.assert_clean()


def test_compare_overlays_runs(browser):
    browser.goto("/compare?run=healthy-fp16&run=diverging-fp16&run=bf16-run")
    browser.wait_for_plots("loss_scale", "grad_norm", "skip_rate", "step_time")
    names = {t["name"] for t in browser.traces("skip_rate")}
    assert names == {"healthy fp16", "diverging fp16"}  # bf16: no scaler, no skip line
    scale_names = {t["name"] for t in browser.traces("loss_scale")}
    assert {"healthy fp16", "diverging fp16", "diverging fp16: skipped steps"} <= scale_names
    assert browser.page.locator("input[name=run]:checked").count() == 3
    browser.shoot("compare")
    browser.assert_clean()


def test_names_a_client_sent_are_shown_as_text(browser):
    browser.goto("/")
    row = browser.page.locator("tr[data-run-id='xss-run']")
    assert row.locator(".run-name > a").inner_text() == XSS
    assert row.locator("td").nth(3).inner_text() == XSS_PROJECT
    browser.goto("/runs/xss-run")
    browser.wait_for_plots("loss_scale")
    assert browser.page.locator("h1").inner_text() == XSS
    with browser.page.expect_navigation():
        browser.page.locator(".run-head a.project-link").click()
    assert browser.page.locator("h1").inner_text() == f"Project {XSS_PROJECT}"
    assert browser.page.locator("#project-runs tbody tr td.run-name > a").inner_text() == XSS
    browser.goto("/runs/xss-run/layers")
    browser.wait_for_plots("grad_heatmap")
    assert XSS_LAYER in browser.page.locator("#precision").inner_text()
    ticks = browser.page.locator("#fig-grad_heatmap .ytick text").evaluate_all(
        "texts => texts.map(t => t.textContent)")
    assert f"{XSS_LAYER} · Linear(8, 8)" in ticks
    browser.goto("/compare?run=xss-run")
    browser.wait_for_plots("loss_scale")
    assert browser.page.locator("img").count() == 0
    browser.shoot("escaping")
    browser.assert_clean()


def test_live_run_page_picks_up_new_steps_without_reload(browser, dashboard):
    trainer = Trainer(dashboard.url, "live-run", "live run", Net(seed=4, norm=False))
    try:
        trainer.train(20).flush()
        browser.goto("/runs/live-run")
        browser.wait_for_plots("loss_scale")
        assert browser.page.locator(".run-title .live").count() == 1
        assert browser.page.locator("#stat-last-step").inner_text() == "19"
        browser.page.evaluate("window.__loadedOnce = true")

        trainer.train(30).flush()
        expect(browser.page.locator("#stat-last-step")).to_have_text("49", timeout=20_000)
        assert browser.page.evaluate("window.__loadedOnce") is True  # no reload
        assert max(browser.x_values("grad_norm")) == 49
        browser.shoot("live-run")
    finally:
        trainer.close()
    browser.assert_clean()


def test_multi_rank_run_overlays_or_picks_ranks(browser, dashboard):
    # one process cannot be two torch.distributed ranks: these are wire batches
    with httpx.Client(base_url=dashboard.url) as api:
        register_run(api, "two-ranks", n_layers=3, environment={"world_size": 2})
        for rank in (0, 1):
            response = post_batch(api, "two-ranks", 0, make_steps(0, 40, 3, skipped={7}),
                                  rank=rank)
            assert response.status_code == 200, response.text
    browser.goto("/runs/two-ranks")
    browser.wait_for_plots("grad_norm")
    assert {t["name"] for t in browser.traces("grad_norm")} >= {"rank 0", "rank 1"}
    with browser.page.expect_navigation():
        browser.page.select_option("select[name=rank]", "1")
    browser.wait_for_plots("grad_norm")
    assert {t["name"] for t in browser.traces("grad_norm")} == {"rank 1", "non-finite"}
    browser.shoot("two-ranks")
    browser.assert_clean()
