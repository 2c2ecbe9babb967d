"""bf16 runs, guarded and not, as their pages tell them (issue #59, items 3, 5 and 7): a
step the guard left out is no GradScaler skip (no loss-scale panel, no scheduler
pitfall), a chart no run has data for is left out with one line that says why, and a
finished run shows when it ended, not an age that froze."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from ampwatch import agent
from tests.conftest import LiveServer
from tests.server.pages.conftest import Browser, open_browser
from tests.server.pages.training import Net, Trainer

pytestmark = pytest.mark.browser
STEPS, NAN_STEP = 200, 50


def train_guarded(url: str) -> None:
    """bf16 autocast without a GradScaler, guard=True, a StepLR scheduler stepped every
    loop step as docs/guard.md says, and a NaN input at step NAN_STEP."""
    torch.set_num_threads(1)
    model = Net(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 50)
    attachment = agent.attach(model, run="guarded-bf16", name="guarded bf16", project="pages",
                              server=url, guard=True, flush_interval=0.5, sample_every=5)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, y = torch.randn(32, 16, generator=generator), torch.randn(32, 8, generator=generator)
        if step == NAN_STEP:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    assert attachment.detach(timeout=30)


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("bf16")
    server = LiveServer(f"sqlite:///{tmp / 'bf16.db'}", tmp / "server.log")
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMPWATCH_SPOOL_DIR", str(tmp / "spool"))
        try:
            train_guarded(server.url)
            Trainer(server.url, "plain-bf16", "plain bf16", Net(seed=3),
                    dtype=torch.bfloat16).train(STEPS).close()
            server.wait_for_analysis()
            yield server
        finally:
            server.stop()


@pytest.fixture
def bf16_browser(chromium, bf16_server: LiveServer, tmp_path: Path) -> Iterator[Browser]:
    opened = open_browser(chromium, bf16_server.url, tmp_path)
    yield opened
    opened.page.context.close()


def plots(browser: Browser) -> list[str]:
    return browser.page.locator(".charts .plot").evaluate_all("els => els.map(e => e.id)")


def test_a_guarded_bf16_run_tells_no_grad_scaler_story(bf16_browser, bf16_server):
    browser = bf16_browser
    browser.goto("/runs/guarded-bf16")
    browser.wait_for_plots("grad_norm", "loss")
    browser.shoot("guarded-bf16")
    assert "fig-loss_scale" not in plots(browser)
    assert browser.page.locator("#charts-left-out").inner_text() == \
        "Not drawn: bf16: no loss scale."
    stats = browser.page.locator("#run-stats").inner_text()
    assert "Loss scale" not in stats
    assert re.search(r"Skipped\s+1 \(0\.50%\)", stats), stats  # the step left out counts
    page = browser.page.locator("body").inner_text()
    assert "GradScaler skipped" not in page and "get_scale" not in page
    findings = httpx.get(f"{bf16_server.url}/api/v1/runs/guarded-bf16/findings",
                         timeout=10).json()["items"]
    assert "scheduler_on_skipped_step" not in {f["code"] for f in findings}
    browser.assert_clean()


def test_compare_leaves_out_what_no_bf16_run_has_and_says_so_once(bf16_browser):
    browser = bf16_browser
    browser.goto("/compare?run=plain-bf16&run=guarded-bf16")
    browser.wait_for_plots("loss", "skip_rate")
    assert plots(browser) == ["fig-loss", "fig-lr", "fig-grad_norm", "fig-skip_rate",
                              "fig-step_time"]
    assert {t["name"] for t in browser.traces("skip_rate")} == {"guarded bf16"}
    assert browser.page.locator("#charts-left-out").inner_text() == \
        "Not drawn: bf16: no loss scale."
    # two runs, neither able to skip a step: one line, no empty panel, no "no steps yet"
    browser.goto("/compare?run=plain-bf16")
    browser.wait_for_plots("loss")
    browser.shoot("compare-plain-bf16")
    assert plots(browser) == ["fig-loss", "fig-lr", "fig-grad_norm", "fig-step_time"]
    assert browser.page.locator("#charts-left-out").inner_text() == (
        "Not drawn: bf16: no loss scale; bf16: no GradScaler or step guard: no skipped steps.")
    assert "no steps yet" not in browser.page.locator("body").inner_text()
    browser.assert_clean()


def test_a_finished_run_shows_when_it_ended(bf16_browser, bf16_server):
    browser = bf16_browser
    browser.goto("/runs/plain-bf16")
    run = httpx.get(f"{bf16_server.url}/api/v1/runs/plain-bf16", timeout=10).json()
    assert run["finished"]
    stats = browser.page.locator("#run-stats").inner_text()
    assert "Last seen" not in stats and " ago" not in stats
    ended = run["last_seen_at"].replace("T", " ")[:16] + " UTC"
    assert browser.page.locator("#stat-seen").inner_text() == ended
    browser.assert_clean()


Y_TICKS = """(id) => Array.from(document.querySelectorAll('#' + id + ' .ytick text'))
    .map(t => { const r = t.getBoundingClientRect();
                return {text: t.textContent, top: r.top, bottom: r.bottom}; })"""


def test_a_layers_log_axes_have_readable_ticks_and_no_empty_panel(bf16_browser):
    """The layer view's log axes tick as the run page's grad norm does (1-2-5), no two
    labels over each other; an MLP layer gets no attention-logit panel."""
    browser = bf16_browser
    browser.goto("/runs/plain-bf16/layers/1")
    browser.wait_for_plots("layer_grad")
    browser.shoot("layer-ticks")
    assert "fig-layer_attn" not in plots(browser)
    for chart in ("fig-layer_grad", "fig-layer_update"):
        ticks = sorted(browser.page.evaluate(Y_TICKS, chart), key=lambda t: t["top"])
        assert len(ticks) >= 2, (chart, ticks)
        crowded = [(a["text"], b["text"]) for a, b in zip(ticks, ticks[1:], strict=False)
                   if b["top"] < a["bottom"] + 2]
        assert not crowded, (chart, [t["text"] for t in ticks])
    browser.assert_clean()
