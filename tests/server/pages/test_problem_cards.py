"""Problem cards on the field runs of issue #35 (points 2, 3 and 4, the presentation
side): ordered by severity then by their leading signal, a risk titled as a risk, each
title naming the card's first step, and a live page whose badge, counts and footer
follow the cards without a reload."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from playwright.sync_api import expect

from tests.server.pages.conftest import GROWING_LAYER
from tests.server.pages.training import GrowingGain, Trainer, mlp

pytestmark = pytest.mark.browser
SEVERITY = {"critical": 2, "warning": 1, "info": 0}
FP16_MAX = 65504.0


def _cards(browser) -> list[dict]:
    return browser.page.locator("#problems .finding").evaluate_all("""cards => cards.map(c => ({
        severity: c.className.match(/finding-(\\w+)/)[1],
        title: c.querySelector('.message').textContent,
        step: c.querySelector('a.step-link') && c.querySelector('a.step-link').textContent}))""")


def test_cards_ordered_by_severity_and_titled_by_their_first_step(field_browser):
    browser = field_browser
    browser.goto("/runs/growing-fp16")
    cards = _cards(browser)
    assert len(cards) >= 2
    ranks = [-SEVERITY[c["severity"]] for c in cards]
    assert ranks == sorted(ranks)
    for card in cards:
        first = re.search(r"step ([\d,]+)", card["step"]).group(1)
        assert card["title"].startswith(f"Step {first}: "), card
    # the overflowing layer's card leads; zero gradients (its symptom) never come first
    assert f"Layer '{GROWING_LAYER}'" in cards[0]["title"]
    assert "exactly zero" not in cards[0]["title"]
    assert int(browser.page.locator("#stat-problems").inner_text()) == len(cards)
    browser.shoot("field-cards")
    browser.assert_clean()


def _wait_for_finding(server: str, run: str, kind: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = httpx.get(f"{server}/api/v1/runs/{run}/findings",
                          params={"kind": kind, "status": "open"}, timeout=10).json()["items"]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no {kind} finding on {run}")


def _run(server: str, run: str) -> dict:
    return httpx.get(f"{server}/api/v1/runs/{run}", timeout=10).json()


def test_a_risk_reads_as_a_risk_and_a_live_page_stays_current(field_browser, field_runs):
    browser, server = field_browser, field_runs.server.url
    model = mlp(seed=2)
    growth = GrowingGain(model, GROWING_LAYER, start=1000.0)
    trainer = Trainer(server, "growing-live", "growing live", model, after_step=growth)
    try:
        trainer.train(10).flush()
        browser.goto("/runs/growing-live")
        browser.wait_for_plots("grad_norm")
        badge = browser.page.locator("#run-status .badge")
        assert badge.inner_text().lower() == "healthy"
        browser.page.evaluate("window.__loadedOnce = true")

        while growth.absmax[-1] < FP16_MAX / 2 * 1.01:
            trainer.train(1)
            assert growth.step < 400, "the layer never came near fp16's maximum"
        trainer.train(6)  # 1.025**6 < 1.2: still below the maximum, and sampled at least once
        assert growth.first_nonfinite is None
        trainer.flush()
        _wait_for_finding(server, "growing-live", "overflow_risk")
        # the layer's risk, swapped in live, comes ahead of its zero gradients (a symptom
        # seen earlier), titled as a risk
        risk = browser.page.locator("#problems .finding .message",
                                    has_text=f"Layer '{GROWING_LAYER}'").first
        expect(risk).to_contain_text("approaching", timeout=30_000)
        title = risk.inner_text()
        match = re.fullmatch(rf"Step [\d,]+: Layer '{GROWING_LAYER}' is approaching fp16's "
                             r"maximum: ([\d.e+]+) of 65504", title)
        assert match, title
        assert FP16_MAX / 2 <= float(match.group(1)) * 1.05 <= max(growth.absmax) * 1.05

        while growth.first_nonfinite is None:
            trainer.train(1)
        trainer.train(30).flush()
        steps = growth.step
        expect(browser.page.locator("#steps-footer")).to_have_text(
            re.compile(rf"^{steps:,} steps in range"), timeout=30_000)
        run = _run(server, "growing-live")
        expect(badge).to_have_text(re.compile(run["status"], re.I), timeout=10_000)
        assert run["status"] != "healthy"
        expect(browser.page.locator("#stat-problems")).to_have_text(str(run["open_problems"]))
        assert browser.page.locator("#problems .finding").count() == run["open_problems"]
        assert browser.page.evaluate("window.__loadedOnce") is True  # no reload
        browser.shoot("growing-live")
    finally:
        trainer.close()
    browser.assert_clean()


def test_the_diverging_bf16_run_is_told_it_diverged_in_its_own_dtype(field_browser):
    browser = field_browser
    browser.goto("/runs/sgd-bf16")
    cards = browser.page.locator("#findings").inner_text()
    first = browser.page.locator("#problems .finding").first
    assert "Training diverged" in first.locator(".message").inner_text()
    assert "lower the learning rate" in first.locator(".fix").inner_text().lower()
    assert "fp16" not in cards and "float16" not in cards
    assert "train in bf16" not in cards and "run it in fp32" not in cards
    browser.shoot("sgd-bf16")
    browser.assert_clean()
