"""Empty, error and partial states and the pages' weight and reach (issue #35, points 9,
10 and 12) on the field runs: a range past the run's end says so, a mistyped address
answers a page, a bf16 run shows nothing it cannot have, plotly.js travels gzipped and
cached, small text meets WCAG AA contrast, and /docs and the dashboard link each other."""

from __future__ import annotations

import httpx
import pytest

from tests.server.pages.conftest import FIELD_STEPS

pytestmark = pytest.mark.browser
CONTRAST = """(selector) => {
  function rgb(text) { return text.match(/[\\d.]+/g).map(Number); }
  function luminance([r, g, b]) {
    const [lr, lg, lb] = [r, g, b].map(v => v / 255).map(v => v <= 0.03928 ? v / 12.92
      : Math.pow((v + 0.055) / 1.055, 2.4));
    return 0.2126 * lr + 0.7152 * lg + 0.0722 * lb;
  }
  function background(el) {
    for (; el; el = el.parentElement) {
      const c = rgb(getComputedStyle(el).backgroundColor);
      if (c.length < 4 || c[3] > 0) return c.slice(0, 3);
    }
    return [255, 255, 255];
  }
  return Array.from(document.querySelectorAll(selector)).filter(el => el.textContent.trim())
    .map(el => {
      const [a, b] = [luminance(rgb(getComputedStyle(el).color)), luminance(background(el))];
      const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
      return [el.textContent.trim().slice(0, 30), ratio];
    });
}"""


def test_a_range_past_the_runs_end_says_so(field_browser):
    browser = field_browser
    browser.goto("/runs/growing-fp16?start=900&end=1000")
    notice = browser.page.locator("#past-end").inner_text()
    assert f"its last step is {FIELD_STEPS - 1}" in notice
    browser.wait_for_plots("grad_norm", "loss")
    for name in ("grad_norm", "loss"):
        text = browser.page.locator(f"#fig-{name} .annotation-text").text_content()
        assert "past the run's end" in text and "no " not in text, text
    browser.assert_clean()


@pytest.mark.parametrize(("address", "word"), [
    ("/runs/growing-fp16?start=abc", "start"),
    ("/runs/growing-fp16/layers?page=0", "page"),
    ("/runs/growing-fp16?start=300&end=100", "ends (100) before it starts (300)"),
])
def test_a_mistyped_address_answers_a_page(field_browser, address, word):
    browser = field_browser
    response = browser.page.goto(browser.base_url + address)
    assert response.status == 400
    assert response.headers["content-type"].startswith("text/html")
    assert word in browser.page.locator("#error").inner_text()
    browser.page.locator("#error a", has_text="without").click()
    browser.page.wait_for_load_state()
    assert browser.page.url == browser.base_url + address.split("?")[0]


def test_a_page_past_the_last_says_which_it_shows(field_browser):
    browser = field_browser
    browser.goto("/runs/growing-fp16/layers?page=99")
    assert "no page 99" in browser.page.locator("#no-such-page").inner_text()
    browser.assert_clean()


def test_a_bf16_run_shows_only_what_it_can_have(field_browser):
    browser = field_browser
    browser.goto("/runs/sgd-bf16")
    browser.wait_for_plots("grad_norm", "loss")
    charts = browser.page.locator(".charts .plot").evaluate_all("els => els.map(e => e.id)")
    assert charts[:2] == ["fig-grad_norm", "fig-loss"]
    assert "fig-loss_scale" not in charts and "fig-memory" not in charts  # no scaler, a CPU
    stats = browser.page.locator("#run-stats").inner_text()
    assert "Loss scale" not in stats and "Skipped" not in stats
    browser.goto("/runs/growing-fp16")
    assert browser.page.locator(".charts .plot").first.get_attribute("id") == "fig-loss_scale"
    browser.goto("/compare?run=growing-fp16&run=sgd-bf16")
    browser.wait_for_plots("skip_rate")
    assert {t["name"] for t in browser.traces("skip_rate")} == {"growing fp16"}
    browser.assert_clean()


def test_plotly_travels_gzipped_and_cached_for_a_year(field_browser, field_runs):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    src = browser.page.locator("script[src^='/static/plotly']").get_attribute("src")
    assert "?v=" in src
    response = httpx.get(field_runs.server.url + src, headers={"Accept-Encoding": "gzip"},
                         timeout=30)
    assert response.headers["content-encoding"] == "gzip"
    assert int(response.headers["content-length"]) < 600_000  # 1.5 MB as it is
    assert "max-age=31536000" in response.headers["cache-control"]
    assert "immutable" in response.headers["cache-control"]
    # httpx unzipped it: the whole of plotly.js's cartesian bundle
    assert len(response.content) > 1_000_000
    assert response.content.startswith(b"/**\n* plotly.js (cartesian - minified)")


def test_small_text_meets_wcag_aa_contrast(field_browser):
    browser = field_browser
    low = []
    for path, selector in (("/", ".badge, .findings-count, td, a"),
                           ("/runs/growing-fp16", ".badge, .finding a, .finding .message, "
                            ".finding .meta, .stats dd, .stats dt, a"),
                           ("/runs/growing-fp16/layers", ".dtype, #precision a"),
                           ("/runs/sgd-bf16/layers", ".dtype")):
        browser.goto(path)
        low += [(path, text, round(ratio, 2)) for text, ratio in
                browser.page.evaluate(CONTRAST, selector) if ratio < 4.5]
    assert low == []
    browser.assert_clean()


def test_the_api_docs_and_the_dashboard_link_each_other(field_browser):
    browser = field_browser
    browser.goto("/")
    with browser.page.expect_navigation():
        browser.page.locator(".topbar a", has_text="API docs").click()
    assert browser.page.url.endswith("/docs")
    back = browser.page.locator(".info a[href='/']")  # in the API's description
    back.wait_for(timeout=15_000)
    assert "runs" in back.inner_text()
