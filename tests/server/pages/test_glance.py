"""The dashboard at a glance, in headless Chromium against a real server: one incident
per root cause, counts that agree with what is shown, a detached run finished at once,
loss-scale and grad-norm charts that read right, one x range (and zoom) per page, and a
compare page that tells overlapping runs apart in plain words."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.server.pages.conftest import Browser, open_browser
from tests.server.pages.training import Net, Trainer
from tests.utils import make_steps, post_batch, register_run

pytestmark = pytest.mark.browser
BOOM_LAYER = "blocks.3.fc"


def _wire_run(api: httpx.Client, run_id: str, steps: list[dict], *, finish: bool = True) -> None:
    register_run(api, run_id, n_layers=3)
    for seq, first in enumerate(range(0, len(steps), 250)):
        events = ([{"step": None, "kind": "finished", "detail": {}}]
                  if finish and first + 250 >= len(steps) else [])
        response = post_batch(api, run_id, seq, steps[first:first + 250], events=events)
        assert response.status_code == 200, response.text


def _collapsing_scale(n: int = 500, fall_from: int = 100) -> list[dict]:
    """Every step from `fall_from` on skips (but one) and divides the scale by 2^8, until
    it passes fp32's smallest value and the scaler holds 0."""
    steps = make_steps(0, n, 3, skipped=set(range(fall_from, n)) - {180})
    exponent = 16
    for step in steps:
        step["loss_scale"] = 2.0 ** exponent if exponent >= -149 else 0.0
        exponent -= 8 * step["skipped"]
        step["scale_after"] = 2.0 ** exponent if exponent >= -149 else 0.0
    return steps


@pytest.fixture(scope="module")
def glance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Real CPU training (a healthy fp16 run, one whose blocks.3.fc overflows fp16 in the
    forward) and wire runs shaped for the charts: a scale that collapses to 0, tiny grad
    norms, and two identical runs."""
    tmp = tmp_path_factory.mktemp("glance")
    server = LiveServer(f"sqlite:///{tmp / 'glance.db'}", tmp / "server.log")
    server.start()
    try:
        Trainer(server.url, "healthy", "healthy", Net(seed=0, norm=False)).train(40).close()
        Trainer(server.url, "boom", "boom", Net(seed=1, boom=1e6)).train(40).close()
        with httpx.Client(base_url=server.url, timeout=30) as api:
            _wire_run(api, "zero-scale", _collapsing_scale())
            tiny = make_steps(0, 300, 3)
            for step in tiny:
                step["grad_norm"] = 1.525879e-5 * (1 + (step["step"] % 7) / 10)
            _wire_run(api, "tiny-grads", tiny)
            for twin in ("twin-a", "twin-b"):
                _wire_run(api, twin, make_steps(0, 300, 3))
        server.wait_for_analysis()  # the pages tell the findings of all it was sent
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(chromium, glance: LiveServer, tmp_path: Path) -> Iterator[Browser]:
    opened = open_browser(chromium, glance.url, tmp_path)
    yield opened
    opened.page.context.close()
    opened.assert_clean()


def _incidents(glance: LiveServer, run_id: str) -> list[dict]:
    return httpx.get(f"{glance.url}/api/v1/runs/{run_id}/incidents?status=open").json()["items"]


def test_one_root_cause_is_one_incident_and_every_count_agrees(page, glance):
    findings = httpx.get(f"{glance.url}/api/v1/runs/boom/findings?status=open").json()
    incidents = _incidents(glance, "boom")
    problems = [i for i in incidents if i["problem"]]
    page.goto("/runs/boom")
    cards = page.page.locator("#problems > li")
    assert cards.count() == len(problems) < findings["total"]
    assert page.page.locator("#stat-problems").inner_text() == str(cards.count())
    head = cards.first
    assert "overflows fp16 in the forward pass" in head.locator(".message").inner_text()
    assert head.locator("a.layer-link").inner_text() == BOOM_LAYER
    assert head.locator(".fix").inner_text().startswith("Fix: Run it in fp32")
    steps = [int(re.sub(r"\D", "", s)) for s in
             head.locator(".timeline .tl-step").all_inner_texts()]
    assert len(steps) >= 2 and steps == sorted(steps)
    page.shoot("incident")

    page.goto("/")
    row = page.page.locator("tr[data-run-id='boom']")
    assert row.locator(".findings-count").inner_text() == str(len(problems))
    page.goto("/runs/boom/layers")
    flags = page.page.locator(f"#precision tr[id='layer-{BOOM_LAYER}'] .flag")
    assert flags.count() == 1  # one badge for the one incident, not one per finding
    assert "forward overflow" in flags.first.inner_text()


def test_a_healthy_run_has_no_open_problems_and_its_notes_are_apart(page, glance):
    notes = [i for i in _incidents(glance, "healthy") if not i["problem"]]
    assert notes  # the small-model note: info, worth knowing
    page.goto("/runs/healthy")
    assert page.page.locator("#stat-problems").inner_text() == "0"
    assert page.page.locator("#problems").count() == 0
    assert "No open problems" in page.page.locator("#findings").inner_text()
    summary = page.page.locator("#findings details.notes summary").inner_text()
    assert summary.startswith(f"{len(notes)} note")
    page.goto("/")
    assert page.page.locator("tr[data-run-id='healthy'] td").nth(7).inner_text() == "0"


def test_a_detached_run_shows_finished_at_once(page):
    page.goto("/")
    row = page.page.locator("tr[data-run-id='healthy']")
    assert row.locator(".finished").inner_text() == "finished"
    assert row.locator(".live").count() == 0
    page.goto("/runs/boom")
    assert page.page.locator(".run-title .finished").count() == 1


def test_loss_scale_chart_spans_every_step_with_even_ticks_and_shaded_streaks(page):
    page.goto("/runs/zero-scale")
    page.wait_for_plots("loss_scale")
    layout = page.page.evaluate("document.getElementById('fig-loss_scale')._fullLayout.xaxis"
                                ".range")
    assert layout[0] <= 0 and layout[1] >= 499  # a scale of 0 does not cut the axis
    traces = {t["name"]: t for t in page.traces("loss_scale")}
    # scales under 2^-24 (here down to 2^-144, then 0) are drawn on one row under the axis
    assert "skipped step" not in traces and traces["scale below 2^-24"]["points"] > 0
    fill = page.page.evaluate("""() => document.getElementById('fig-loss_scale')._fullData
        .filter(t => t.name === 'skipped steps').map(t => t.fill)""")
    assert fill == ["toself", "none"]  # the shaded spans, and their steps' hover points
    x = page.x_values("loss_scale", [t["name"] for t in page.traces("loss_scale")]
                      .index("skipped steps"))
    assert sum(v is None for v in x) == 2  # steps 100-179 and 181-499: two streaks
    ticks = _tick_texts(page, "loss_scale")
    powers = [int(t.removeprefix("2")) for t in ticks if t != "0"]
    assert powers and powers[-1] == 16
    assert len({b - a for a, b in zip(powers, powers[1:], strict=False)}) == 1, ticks
    page.shoot("loss-scale")


def _tick_texts(page: Browser, name: str) -> list[str]:
    return page.page.locator(f"#fig-{name} .ytick text").evaluate_all(
        "texts => texts.map(t => t.textContent.replace(/\u200b/g, ''))")


def test_grad_norm_ticks_read_as_a_person_writes_them(page):
    page.goto("/runs/tiny-grads")
    page.wait_for_plots("grad_norm")
    ticks = _tick_texts(page, "grad_norm")
    assert len(ticks) >= 2
    for tick in ticks:
        assert re.fullmatch(r"\d(\.\d{1,2})?e-\d{1,2}|0\.\d{1,5}|\d+", tick), ticks


def test_a_pages_charts_share_one_x_range_and_one_zoom(page):
    page.goto("/runs/zero-scale")
    names = ["loss_scale", "grad_norm", "loss", "lr", "phases"]
    page.wait_for_plots(*names)
    ranges = _x_ranges(page, names)
    assert len({tuple(r) for r in ranges.values()}) == 1, ranges
    page.page.evaluate("Plotly.relayout('fig-loss', {'xaxis.range': [100, 200]})")
    page.page.wait_for_function("""() => ['loss_scale', 'grad_norm', 'phases'].every(n =>
        document.getElementById('fig-' + n)._fullLayout.xaxis.range[1] === 200)""")

    page.goto("/runs/boom/layers")
    page.wait_for_plots("grad_heatmap", "act_heatmap")
    heat = _x_ranges(page, ["grad_heatmap", "act_heatmap"])
    assert heat["grad_heatmap"] == heat["act_heatmap"], heat
    page.page.evaluate("Plotly.relayout('fig-act_heatmap', {'xaxis.range': [10, 20]})")
    page.page.wait_for_function(
        "document.getElementById('fig-grad_heatmap')._fullLayout.xaxis.range[1] === 20")


def _x_ranges(page: Browser, names: list[str]) -> dict[str, list[float]]:
    return {name: page.page.evaluate(
        f"document.getElementById('fig-{name}')._fullLayout.xaxis.range") for name in names}


def test_compare_tells_overlapping_runs_apart_in_plain_words(page):
    page.goto("/compare?runs=twin-a,twin-b,boom,healthy")  # the old parameter redirects
    assert "runs=" not in page.page.url and page.page.url.count("run=") == 4
    page.wait_for_plots("loss_scale", "grad_norm", "skip_rate", "step_time")
    dashes = page.page.evaluate("""() => Object.fromEntries(document.getElementById(
        'fig-loss_scale')._fullData.filter(t => t.mode === 'lines').map(t => [t.name,
        t.line.dash]))""")
    assert len({dashes["twin-a"], dashes["twin-b"], dashes["boom"], dashes["healthy"]}) == 4
    coincide = page.page.locator(".coincide[data-chart=grad_norm]").all_inner_texts()
    assert any("twin-a and twin-b coincide" in note for note in coincide), coincide
    label = page.page.locator(".pick-list label", has=page.page.locator(
        "input[value='twin-a']")).inner_text()
    assert label.count("twin-a") == 1  # the id is not printed again when it is the name
    clipped = page.page.evaluate("""() => Array.from(document.querySelectorAll('.badge'))
        .filter(b => b.scrollWidth > b.clientWidth + 1).map(b => b.textContent)""")
    assert clipped == []
    terms = page.page.locator(".term")
    assert terms.count() >= 4
    assert all(t for t in terms.evaluate_all("els => els.map(e => e.title)"))
    assert page.page.locator("input[name=run]:checked").count() == 4
    page.shoot("compare-four")
