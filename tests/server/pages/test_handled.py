"""Issue #59 point 4: "Mark handled" changes what counts as open, everywhere. A handled
problem leaves the run's status, its counts (page, runs list, compare, API, /metrics),
moves below the open cards struck through, and reopens when its signal returns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.server.pages.conftest import open_browser
from tests.server.pages.training import Net, Trainer

pytestmark = pytest.mark.browser
RUN = "boom-fp16"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("handled")
    live = LiveServer(f"sqlite:///{tmp / 'handled.db'}", tmp / "server.log")
    live.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMPWATCH_SPOOL_DIR", str(tmp / "spool"))
        try:
            trainer = Trainer(live.url, RUN, "boom fp16", Net(seed=1, width=100, boom=1e6))
            trainer.train(40).flush()
            live.wait_for_analysis()
            live.trainer = trainer  # the test trains on later, to bring the signal back
            yield live
        finally:
            trainer.close()
            live.stop()


def _api(server: LiveServer, path: str) -> dict:
    return httpx.get(f"{server.url}/api/v1{path}", timeout=10).json()


def _metric_open(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ampwatch_run_open_findings{") and f'run="{RUN}"' in line
               and 'severity="info"' not in line)


def test_mark_handled_closes_the_problem_everywhere_until_it_returns(chromium, server,
                                                                     tmp_path: Path):
    before = _api(server, f"/runs/{RUN}")
    assert before["status"] == "critical" and before["open_problems"] >= 1
    assert _metric_open(server) >= 1
    browser = open_browser(chromium, server.url, tmp_path)
    page = browser.page
    browser.goto(f"/runs/{RUN}")
    cards = page.locator("#problems .finding")
    n_open = cards.count()
    assert n_open == before["open_problems"]
    first = cards.first
    incident = int(first.get_attribute("data-incident"))
    first.locator("input[name=text]").fill("lowered the init scale")
    first.locator("button", has_text="Mark handled").click()
    page.wait_for_load_state("networkidle")

    # the page: one card fewer open, the handled one struck through below them
    assert page.locator("#problems .finding").count() == n_open - 1
    handled = page.locator(f"#handled .finding[data-incident='{incident}']")
    assert handled.count() == 1
    assert handled.locator(".message").evaluate(
        "m => getComputedStyle(m).textDecorationLine") == "line-through"
    assert int(page.locator("#stat-problems").inner_text()) == n_open - 1
    browser.shoot("handled-card")

    # the API, the runs list, compare and /metrics say the same
    after = _api(server, f"/runs/{RUN}")
    assert after["open_problems"] == n_open - 1
    if n_open == 1:
        assert after["status"] == "healthy"
    listed = next(r for r in _api(server, "/runs")["items"] if r["id"] == RUN)
    assert (listed["open_problems"], listed["status"]) == (after["open_problems"],
                                                           after["status"])
    statuses = {i["id"]: i["status"] for i in _api(server, f"/runs/{RUN}/incidents")["items"]}
    assert statuses[incident] == "handled"
    browser.goto(f"/compare?run={RUN}&run={RUN}")
    assert str(after["open_problems"]) in page.locator("table").first.inner_text()
    assert _metric_open(server) < before["open_findings"]

    # the signal returns: the incident is open again
    server.trainer.train(20).flush()
    server.wait_for_analysis()
    statuses = {i["id"]: i["status"] for i in _api(server, f"/runs/{RUN}/incidents")["items"]}
    assert statuses[incident] == "open"
    assert _api(server, f"/runs/{RUN}")["open_problems"] == n_open
    browser.goto(f"/runs/{RUN}")
    assert page.locator("#problems .finding").count() == n_open
    browser.assert_clean()
    page.context.close()
