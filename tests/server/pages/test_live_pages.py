"""Live pages that never freeze (issue #50, points 1 and 3), against a real server and
real CPU training: a page opened before a run's first batch fills in when the batches
come, a run that goes quiet is told as "stopped reporting" and picked up again when it
resumes, and a training process killed with SIGKILL is told apart from a finished run.
The server's `live_seconds` is 3 s here (60 s by default) so a quiet spell is short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from tests.conftest import LiveServer
from tests.server.pages.conftest import Browser, open_browser
from tests.server.pages.training import Net, Trainer
from tests.server.test_metrics import reads_as_the_api, scrape, value

pytestmark = pytest.mark.browser
LIVE_SECONDS = 3
ROOT = Path(__file__).resolve().parents[3]
# a child that trains until killed, appending each step it ran to a file (the truth of how
# far it got) and saying after each delivered send which step it reached
KILLED_CHILD = """
import sys
from tests.server.pages.training import Net, Trainer
trainer = Trainer(sys.argv[1], "killed-run", "killed run", Net(seed=6, norm=False))
ran = open(sys.argv[2], "a", buffering=1)
step = 0
while True:
    trainer.train(1)
    ran.write(f"{step}\\n")
    step += 1
    if step in (20, 40):  # the test reads two delivered sends; then batches by time
        trainer.flush()
        print(step - 1, flush=True)
"""


@pytest.fixture(scope="module")
def quick_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("live-pages")
    server = LiveServer(f"sqlite:///{tmp / 'live.db'}", tmp / "server.log",
                        env={"AMPWATCH_LIVE_SECONDS": str(LIVE_SECONDS)})
    server.start(timeout=120)
    yield server
    server.stop()


@pytest.fixture
def quick_browser(chromium, quick_server: LiveServer, tmp_path: Path) -> Iterator[Browser]:
    opened = open_browser(chromium, quick_server.url, tmp_path)
    yield opened
    opened.page.context.close()


def api_run(server: LiveServer, run_id: str) -> dict:
    return httpx.get(f"{server.url}/api/v1/runs/{run_id}", timeout=10).json()


def test_a_page_opened_before_the_first_batch_follows_the_run_through_a_pause(
        quick_browser, quick_server):
    browser = quick_browser
    trainer = Trainer(quick_server.url, "early-run", "early run", Net(seed=5, norm=False))
    try:
        trainer.flush()  # registers the run (with its environment): no step yet
        assert api_run(quick_server, "early-run")["steps"] == 0
        browser.goto("/runs/early-run")
        browser.wait_for_plots("loss_scale")
        assert browser.page.locator(".run-title .waiting").inner_text() == "waiting for data"
        assert "GradScaler" in browser.page.locator("#environment").inner_text()
        scale_note = browser.page.locator("#fig-loss_scale .annotation-text").text_content()
        assert scale_note == "no loss scale recorded yet"  # not "no GradScaler in this run"
        lister = open_browser(browser.page.context.browser, quick_server.url, browser.shots)
        lister.goto("/")
        assert "waiting for data" in lister.page.locator(
            "tr[data-run-id='early-run']").inner_text()
        browser.page.evaluate("window.__loadedOnce = true")

        trainer.train(30).flush()
        expect(browser.page.locator("#stat-last-step")).to_have_text("29", timeout=15_000)
        assert browser.page.locator(".run-title .waiting").count() == 0
        row = lister.page.locator("tr[data-run-id='early-run']")
        expect(row.locator("td").nth(4)).to_have_text("29", timeout=15_000)  # last step
        assert row.locator(".waiting").count() == 0

        # quiet for longer than live_seconds: an eval or a checkpoint
        expect(browser.page.locator("#stopped-reporting")).to_contain_text(
            "at step 29", timeout=15_000)
        assert browser.page.locator(".run-title .stopped").inner_text() == "stopped reporting"
        browser.shoot("stopped-reporting")

        trainer.train(20).flush()  # it resumes: the page, still polling, follows
        expect(browser.page.locator("#stat-last-step")).to_have_text("49", timeout=20_000)
        assert max(browser.x_values("grad_norm")) == 49
        assert browser.page.evaluate("window.__loadedOnce") is True  # never reloaded
    finally:
        trainer.close()
    expect(browser.page.locator(".run-title .finished")).to_have_count(1, timeout=20_000)
    samples = scrape(quick_server.url)  # finished: in no gauge of /metrics
    assert value(samples, "ampwatch_run_last_step", run="early-run") is None
    assert value(samples, "ampwatch_run_reporting", run="early-run", state="live") is None
    browser.assert_clean()
    lister.assert_clean()
    lister.page.context.close()


def test_a_killed_training_process_is_told_apart_from_a_finished_run(
        quick_browser, quick_server, tmp_path):
    browser = quick_browser
    ran = tmp_path / "ran.txt"
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, quick_server.url, str(ran)],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "AMPWATCH_SPOOL_DIR": str(tmp_path / "spool")})
    try:
        delivered = int(child.stdout.readline())  # a send the child saw delivered
        browser.goto("/runs/killed-run")
        browser.wait_for_plots("grad_norm")
        expect(browser.page.locator(".run-title .live")).to_have_count(1)
        delivered = max(delivered, int(child.stdout.readline()))
        # freeze the child while the server has heard of steps it has not stored (the
        # agent's heartbeat runs ahead of its batches), then kill it there
        for _ in range(200):
            seen = api_run(quick_server, "killed-run")
            if (seen["reached_step"] or -1) <= seen["last_step"]:
                time.sleep(0.02)
                continue
            child.send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # a request under way when it froze can no longer complete
            frozen = api_run(quick_server, "killed-run")
            if frozen["reached_step"] > frozen["last_step"]:
                break
            child.send_signal(signal.SIGCONT)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
    run = api_run(quick_server, "killed-run")
    assert not run["finished"]
    assert run["last_step"] >= delivered
    # truth: the steps the child ran, from its own file; the server stored steps 0..N
    # and heard of M: every step of N+1..M ran, and none of them arrived
    steps_run = [int(line) for line in ran.read_text().split()]
    assert steps_run == list(range(len(steps_run)))
    stored, reached = run["last_step"], run["reached_step"]
    assert run["steps"] == stored + 1 and stored < reached <= steps_run[-1] + 1
    assert (run["steps"], run["reached_step"]) == (frozen["steps"], frozen["reached_step"])

    status = browser.page.locator(".run-title .stopped")
    expect(status).to_have_text("stopped reporting", timeout=20_000)
    assert browser.page.locator(".run-title .finished").count() == 0
    notice = browser.page.locator("#stopped-reporting").inner_text()
    assert f"at step {run['last_step']:,}" in notice and "killed" in notice
    # one count of the steps lost (services/runs.run_state), the same on the page,
    # the API and `ampwatch show`
    run = api_run(quick_server, "killed-run")
    lost = max(reached - stored, run["missing_steps"])
    assert (run["reporting"], run["steps_lost"]) == ("stopped", lost)
    reads_as_the_api(scrape(quick_server.url), run)  # /metrics: stopped, lost, last seen
    assert browser.page.locator("#steps-lost").inner_text() == (
        f"{lost:,} step{'' if lost == 1 else 's'} lost")
    assert browser.page.locator("#steps-in-memory").inner_text() == (
        f": the process had reached step {reached:,}, and steps {stored + 1:,}\u2013"
        f"{reached:,} were in its memory or spool and never arrived")
    assert browser.page.locator("#stat-last-step").inner_text() == f"{run['last_step']:,}"
    browser.shoot("killed-run")
    env = {**os.environ, "AMPWATCH_SERVER": quick_server.url, "PYTHONPATH": str(ROOT)}
    show = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "show", "killed-run"],
                          capture_output=True, text=True, env=env, check=True).stdout
    assert "stopped reporting" in show and "steps lost:" in show
    assert f" {lost}\n" in show.split("steps lost:")[1][:40] + "\n"

    # `ampwatch sync` of what the killed child left in its spool: the run stays stopped,
    # last seen is still the time of its data, not of the upload
    spool = tmp_path / "spool"
    synced_at = time.time()
    if spool.exists():
        subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "sync", str(spool)],
                       capture_output=True, text=True, env=env, timeout=60)
    synced = api_run(quick_server, "killed-run")
    assert (synced["live"], synced["reporting"]) == (False, "stopped")
    last_seen = datetime.fromisoformat(synced["last_seen_at"]).timestamp()
    assert last_seen < synced_at - LIVE_SECONDS  # the time of its data, not the sync's
    assert synced["steps_lost"] >= lost
    reads_as_the_api(scrape(quick_server.url), synced)
    show = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "show", "killed-run"],
                          capture_output=True, text=True, env=env, check=True).stdout
    assert "stopped reporting" in show

    browser.goto("/")
    row = browser.page.locator("tr[data-run-id='killed-run']")
    assert row.locator(".stopped").inner_text() == "stopped reporting"
    assert f"last step {run['last_step']:,}" in row.locator(".stopped").get_attribute("title")
    browser.assert_clean()


def test_a_zoom_is_kept_across_live_updates_and_in_the_link(quick_browser, quick_server):
    browser = quick_browser
    trainer = Trainer(quick_server.url, "zoomed-run", "zoomed run", Net(seed=7, norm=False))
    try:
        trainer.train(40).flush()
        browser.goto("/runs/zoomed-run")
        browser.wait_for_plots("loss", "grad_norm", "loss_scale")
        browser.page.locator("#fig-loss").scroll_into_view_if_needed()
        box = browser.page.locator("#fig-loss .nsewdrag").bounding_box()
        mouse = browser.page.mouse
        # a box zoom dragged by hand over the middle of the loss chart
        mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.2)
        mouse.down()
        mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.6, steps=8)
        mouse.up()
        zoom = browser.page.evaluate("""() => {
            const el = document.getElementById('fig-loss');
            return {x: el.layout.xaxis.range.slice(), y: el.layout.yaxis.range.slice()};
        }""")
        assert 5 < zoom["x"][0] < zoom["x"][1] < 30, zoom
        expect(browser.page).to_have_url(
            f"{browser.base_url}/runs/zoomed-run?start={int(zoom['x'][0])}"
            f"&end={-int(-zoom['x'][1] // 1)}", timeout=5_000)

        trainer.train(30).flush()
        expect(browser.page.locator("#stat-last-step")).to_have_text("69", timeout=15_000)
        assert max(browser.x_values("grad_norm")) == 69  # the new steps are drawn
        ranges = browser.page.evaluate("""() => Array.from(document.querySelectorAll('.plot'))
            .map(el => [el.id, el.layout.xaxis.range.slice()])""")
        for name, x_range in ranges:
            assert x_range == pytest.approx(zoom["x"]), name
        y_range = browser.page.evaluate(
            "document.getElementById('fig-loss').layout.yaxis.range.slice()")
        assert y_range == pytest.approx(zoom["y"])
        browser.shoot("zoom-kept")
    finally:
        trainer.close()
    browser.assert_clean()
