"""Compare opens its loss chart on a log axis when the runs' losses lie orders of
magnitude apart (issue #50: one run at 5e3 flattened three others on a linear one)."""

from __future__ import annotations

import httpx
import pytest

from tests.utils import make_steps, post_batch, register_run

pytestmark = pytest.mark.browser


def loss_run(api: httpx.Client, run_id: str, factor: float) -> None:
    register_run(api, run_id, n_layers=2)
    steps = make_steps(0, 50, 2)
    for step in steps:
        step["loss"] *= factor
    assert post_batch(api, run_id, 0, steps).status_code == 200


def test_compare_draws_far_apart_losses_on_a_log_axis(field_browser, field_runs):
    with httpx.Client(base_url=field_runs.server.url, timeout=30) as api:
        loss_run(api, "loss-2", 1.0)
        loss_run(api, "loss-5e3", 2500.0)
        loss_run(api, "loss-3", 1.5)
    browser = field_browser
    browser.goto("/compare?run=loss-2&run=loss-5e3")
    browser.wait_for_plots("loss")
    assert browser.page.locator(".chart-tools[data-for='fig-loss'] .log-axis").is_checked()
    assert browser.page.evaluate(
        "document.getElementById('fig-loss').layout.yaxis.type") == "log"
    browser.page.locator(".chart-tools[data-for='fig-loss'] .log-axis").uncheck()
    assert browser.page.evaluate(
        "document.getElementById('fig-loss').layout.yaxis.type") == "linear"
    # losses of one order: linear, as before
    browser.goto("/compare?run=loss-2&run=loss-3")
    browser.wait_for_plots("loss")
    assert browser.page.evaluate(
        "document.getElementById('fig-loss').layout.yaxis.type") == "linear"
    browser.assert_clean()
