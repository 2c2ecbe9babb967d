"""What a W&B or TensorBoard user looks for (issue #50): the run's config and its diff on
compare, runs filtered and sorted by tag and column, notes and handled incidents; in
Chromium on runs sent over the wire API."""

from __future__ import annotations

import httpx
import pytest

from tests.utils import make_steps, post_batch, register_run

pytestmark = pytest.mark.browser


def test_config_on_the_run_page_and_diffed_on_compare(field_browser, field_runs):
    with httpx.Client(base_url=field_runs.server.url, timeout=30) as api:
        for run_id, lr in (("cfg-a", 3e-4), ("cfg-b", 1e-3)):
            register_run(api, run_id, n_layers=2, config={
                "optimizer": {"name": "adamw", "lr": lr}, "batch_size": 32,
                **({"warmup": 100} if run_id == "cfg-b" else {})})
            assert post_batch(api, run_id, 0, make_steps(0, 20, 2)).status_code == 200
    browser = field_browser
    browser.goto("/runs/cfg-a")
    keys = browser.page.locator("#config dt").all_inner_texts()
    assert keys == ["batch_size", "optimizer.lr", "optimizer.name"]
    assert browser.page.locator("#config dd").all_inner_texts() == ["32", "0.0003", "adamw"]

    browser.goto("/compare?run=cfg-a&run=cfg-b")
    rows = browser.page.locator("#config-diff tbody tr").all_inner_texts()
    assert [r.split("\t") for r in rows] == [["optimizer.lr", "0.0003", "0.001"],
                                             ["warmup", "—", "100"]]
    assert "2 more the same" in browser.page.locator("#config-diff h2").inner_text()
    browser.assert_clean()


def test_a_note_and_a_handled_incident_from_the_run_page(field_browser, field_runs):
    with httpx.Client(base_url=field_runs.server.url, timeout=30) as api:
        register_run(api, "noted-page", n_layers=2)
        steps = make_steps(0, 30, 2, skipped={5})
        assert post_batch(api, "noted-page", 0, steps).status_code == 200
    browser = field_browser
    browser.goto("/runs/noted-page")
    browser.page.fill("#notes input[name=text]", "restarted with lr 1e-4")
    with browser.page.expect_navigation():
        browser.page.click("#notes button[type=submit]")
    assert "restarted with lr 1e-4" in browser.page.locator("#notes").inner_text()

    card = browser.page.locator("#findings li.incident").first
    incident = int(card.get_attribute("data-incident"))
    card.locator("input[name=text]").fill("dropped the bad shard")
    with browser.page.expect_navigation():
        card.locator("button", has_text="Mark handled").click()
    card = browser.page.locator(f"#findings li[data-incident='{incident}']")
    assert "✓ handled" in card.inner_text() and "dropped the bad shard" in card.inner_text()
    notes = httpx.get(f"{field_runs.server.url}/api/v1/runs/noted-page/notes",
                      timeout=10).json()["items"]
    assert [(n["text"], n["incident"], n["handled"]) for n in notes] == [
        ("restarted with lr 1e-4", None, False), ("dropped the bad shard", incident, True)]

    with browser.page.expect_navigation():
        card.locator("button", has_text="Reopen").click()
    assert browser.page.locator(f"#findings li[data-incident='{incident}'] .handled").count() == 0
    browser.assert_clean()


def test_runs_filtered_by_tag_and_sorted_by_a_column(field_browser, field_runs):
    with httpx.Client(base_url=field_runs.server.url, timeout=30) as api:
        for run_id, count in (("tagged-b", 30), ("tagged-a", 10), ("tagged-c", 20)):
            register_run(api, run_id, n_layers=2, tags=["sweep 7", "lr-search"])
            assert post_batch(api, run_id, 0, make_steps(0, count, 2)).status_code == 200
    browser = field_browser
    browser.goto("/")
    with browser.page.expect_navigation():
        browser.page.locator("tr[data-run-id='tagged-a'] a.tag", has_text="sweep 7").click()
    assert "tag=sweep+7" in browser.page.url

    def ids() -> list[str]:
        return browser.page.locator("tbody tr").evaluate_all(
            "rows => rows.map(r => r.dataset.runId)")

    assert ids() == ["tagged-c", "tagged-a", "tagged-b"]  # newest first
    with browser.page.expect_navigation():
        browser.page.locator("th a.sort", has_text="Run").click()
    assert ids() == ["tagged-a", "tagged-b", "tagged-c"]
    assert browser.page.locator("th[aria-sort='ascending']").inner_text().startswith("Run")
    with browser.page.expect_navigation():
        browser.page.locator("th a.sort", has_text="Last step").click()
    assert ids() == ["tagged-b", "tagged-c", "tagged-a"]  # 29, 19, 9: largest first
    with browser.page.expect_navigation():
        browser.page.locator("th a.sort", has_text="Last step").click()
    assert ids() == ["tagged-a", "tagged-c", "tagged-b"]
    assert browser.page.locator("select[name=tag]").input_value() == "sweep 7"
    with browser.page.expect_navigation():
        browser.page.select_option("select[name=tag]", "bf16")
    assert ids() == ["sgd-bf16"] and "sort=last_step" in browser.page.url
    with browser.page.expect_navigation():
        browser.page.locator("tr[data-run-id='sgd-bf16'] a.project-link").click()
    assert browser.page.url.endswith("/projects/pages")  # the project's page: all its runs
    assert {"growing-fp16", "sgd-bf16"} <= set(ids())
    browser.assert_clean()
