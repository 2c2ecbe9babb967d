"""Charts on the field runs (issue #35, points 7 and 8): compare draws loss and learning
rate with smoothing, names every span and marker by its run and takes its runs from
the runs list's checkboxes; the loss-scale axis stays readable after a collapse and
says where the scale fell; hover reads every line at a step and names a skipped span;
the loss has a log toggle; the abs-max colour bar marks fp16's maximum; inf and NaN
have a legend entry each; the legend clears the toolbar."""

from __future__ import annotations

import math
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.server.pages.conftest import GROWING_LAYER

pytestmark = pytest.mark.browser
COMPARE = "/compare?run=growing-fp16&run=sgd-bf16"


def _layout(browser, name: str, path: str):
    return browser.page.evaluate(f"document.getElementById('fig-{name}')._fullLayout.{path}")


def test_compare_draws_loss_and_lr_and_names_every_span_and_marker(field_browser):
    browser = field_browser
    browser.goto(COMPARE)
    browser.wait_for_plots("loss", "lr", "loss_scale", "grad_norm")
    loss = browser.traces("loss")
    assert {t["name"] for t in loss} >= {"growing fp16", "sgd lr=30 bf16"}
    assert {t["name"] for t in browser.traces("lr")} == {"growing fp16", "sgd lr=30 bf16"}
    names = {t["name"] for t in browser.traces("loss_scale")}
    assert "growing fp16: skipped steps" in names and "skipped steps" not in names
    markers = {t["name"] for t in browser.traces("grad_norm")} - {"growing fp16",
                                                                   "sgd lr=30 bf16"}
    assert markers and all(": " in name for name in markers), markers

    smoothed = browser.page.evaluate("""() => document.getElementById('fig-loss')._fullData
        .filter(t => t.meta === 'loss-smooth').map(t => Array.from(t.y).slice(0, 50))""")
    browser.page.locator(".chart-tools[data-for='fig-loss'] .smoothing").fill("0")
    raw = browser.page.evaluate("""() => document.getElementById('fig-loss')._fullData
        .filter(t => t.meta === 'loss-smooth').map(t => Array.from(t.y).slice(0, 50))""")
    assert raw != smoothed
    raws = browser.page.evaluate("""() => document.getElementById('fig-loss')._fullData
        .filter(t => t.meta === 'loss-raw').map(t => Array.from(t.y).slice(0, 50))""")
    assert all(math.isclose(a, b, rel_tol=1e-9) for r, w in zip(raw, raws, strict=True)
               for a, b in zip(r, w, strict=True))  # smoothing 0: the raw loss
    browser.page.locator(".chart-tools[data-for='fig-loss'] .log-axis").check()
    browser.page.wait_for_function(
        "document.getElementById('fig-loss')._fullLayout.yaxis.type === 'log'")
    browser.shoot("compare-loss")
    browser.assert_clean()


def test_the_runs_list_picks_runs_to_compare(field_browser):
    browser = field_browser
    browser.goto("/")
    for run in ("growing-fp16", "sgd-bf16"):
        browser.page.locator(f"tr[data-run-id='{run}'] input[name=run]").check()
    with browser.page.expect_navigation():
        browser.page.locator("button.compare-picked").click()
    assert urlsplit(browser.page.url).path == "/compare"
    assert set(parse_qs(urlsplit(browser.page.url).query)["run"]) == {"growing-fp16",
                                                                      "sgd-bf16"}
    browser.assert_clean()


def test_the_loss_scale_axis_stays_readable_after_a_collapse(field_browser, field_runs):
    browser = field_browser
    fell = next(step for step, scale in enumerate(field_runs.scales) if scale < 2.0 ** -24)
    browser.goto("/runs/growing-fp16")
    browser.wait_for_plots("loss_scale")
    bottom, top = _layout(browser, "loss_scale", "yaxis.range")
    assert bottom >= -27 and top >= 16  # not 2^-144: 2^16..1 keeps its room
    ticks = _layout(browser, "loss_scale", "yaxis.ticktext")
    assert ticks[0] in ("0", "<2<sup>-24</sup>")
    notes = [a["text"] for a in _layout(browser, "loss_scale", "annotations")]
    assert any(f"at step {fell:,}" in note and "fell to" in note for note in notes), notes
    assert _layout(browser, "loss_scale", "hovermode") == "x unified"
    assert _layout(browser, "loss_scale", "legend.x") == 0  # the toolbar is top right
    browser.assert_clean()


def test_hovering_a_skipped_span_names_it(field_browser, field_runs):
    browser = field_browser
    skipped = [s for s in range(len(field_runs.scales) - 1)
               if field_runs.scales[s + 1] < field_runs.scales[s]]
    browser.goto("/runs/growing-fp16")
    browser.wait_for_plots("loss_scale")
    step = skipped[-1]
    browser.page.locator("#fig-loss_scale").scroll_into_view_if_needed()
    point = browser.page.evaluate("""(step) => {
        const el = document.getElementById('fig-loss_scale'), box = el.getBoundingClientRect();
        const xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis;
        return [box.left + xa._offset + xa.l2p(step), box.top + ya._offset + ya._length / 2];
    }""", step)
    browser.page.mouse.move(*point, steps=3)
    label = browser.page.locator("#fig-loss_scale .hoverlayer", has_text="skipped: steps")
    label.wait_for(timeout=5_000)
    assert "in this span" in label.text_content()
    browser.assert_clean()


def test_the_heatmaps_mark_the_dtypes_maximum_and_tell_inf_from_nan(field_browser):
    browser = field_browser
    browser.goto("/runs/growing-fp16/layers")
    browser.wait_for_plots("act_heatmap")
    bar = browser.page.evaluate("""() => document.getElementById('fig-act_heatmap')._fullData
        .filter(t => t.type === 'heatmap' && t.showscale)[0].colorbar.ticktext""")
    assert "fp16 max 65504" in bar
    legend = browser.page.locator("#fig-act_heatmap .legendtext").evaluate_all(
        "texts => texts.map(t => t.textContent)")
    assert "inf" in legend or "NaN" in legend
    assert "NaN/inf" not in legend
    assert f"first offender: {GROWING_LAYER}" in str(_layout(browser, "act_heatmap",
                                                             "annotations"))
    browser.assert_clean()


def test_grad_norm_and_phases_smooth_and_log_and_keep_it_in_the_address(field_browser):
    browser = field_browser
    browser.goto("/runs/sgd-bf16")
    browser.wait_for_plots("grad_norm", "phases")
    raw = browser.lines("phases")
    assert _layout(browser, "grad_norm", "yaxis.type") == "log"  # the grad norm's default
    smoothed = browser.smooth("phases", 0.9, raw)  # each phase its own EMA
    browser.log_axis("phases", True)
    browser.log_axis("grad_norm", False)
    address = browser.page.url
    assert "smooth_phases=0.9" in address and "log_phases=1" in address
    assert "log_grad_norm=0" in address

    browser.page.goto(address)  # the link opens on the same view
    browser.wait_for_plots("grad_norm", "phases")
    browser.page.wait_for_function(
        "document.getElementById('fig-phases')._fullLayout.yaxis.type === 'log'")
    assert _layout(browser, "grad_norm", "yaxis.type") == "linear"
    assert browser.lines("phases") == smoothed
    browser.assert_clean()
