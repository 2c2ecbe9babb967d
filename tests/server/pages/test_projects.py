"""Across runs, which settings break training (issue #60): real sweeps of a small MLP
trained on the CPU in bf16 autocast with plain SGD, each run attached with its config,
sent to a real server. A high learning rate makes the loss go inf/NaN; the seed does
not matter. The truth is each run's own losses, recorded here; the project's API, page
and CLI must name lr first with a threshold that splits the runs exactly as their losses
do, and flag a derived key (warmup = lr * 100) as confounded with lr."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from ampwatch import agent
from ampwatch.client import Client
from ampwatch.client.cli import main
from tests.conftest import LiveServer, agent_errors_fail
from tests.server.pages.conftest import open_browser
from tests.server.pages.training import mlp

SWEEP = "lr-sweep"
CONFOUNDED = "warmup-sweep"
# bf16, SGD, MSE on random targets: this MLP's loss goes inf/NaN within a few steps at
# lr 30 and above and stays finite below 10
LRS = (0.003, 0.01, 0.1, 1.0, 30.0, 60.0, 100.0)
SEEDS = (0, 1)
STEPS = 40
DOCS_IMG = Path(__file__).resolve().parents[3] / "docs" / "img"


@dataclass(frozen=True)
class Sweeps:
    server: LiveServer
    diverged: dict[str, bool]  # run id -> its loss went inf/NaN (the test's own truth)
    lr: dict[str, float]


def train(url: str, run: str, project: str, lr: float, seed: int, **config) -> bool:
    """One run attached with its config; whether its loss ever went inf/NaN."""
    torch.manual_seed(seed)
    model = mlp(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    attachment = agent.attach(model, run=run, project=project, name=f"lr={lr:g} seed={seed}",
                              tags=["sweep"], server=url, sample_every=5, flush_interval=0.5,
                              record=False,
                              config={"lr": lr, "seed": seed, "optimizer": "sgd", **config})
    generator = torch.Generator().manual_seed(100 + seed)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 16, generator=generator)
        y = torch.randn(32, 16, generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert attachment.detach(timeout=30), "the agent did not deliver its steps"
    return not all(math.isfinite(value) for value in losses)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sweeps]:
    """14 runs of lr x seed in SWEEP; 8 in CONFOUNDED where warmup = lr * 100."""
    tmp = tmp_path_factory.mktemp("projects")
    server = LiveServer(f"sqlite:///{tmp / 'projects.db'}", tmp / "server.log")
    server.start(timeout=120)
    torch.set_num_threads(1)
    diverged, lrs = {}, {}
    try:
        with pytest.MonkeyPatch.context() as patch, agent_errors_fail():
            patch.setenv("AMPWATCH_SPOOL_DIR", str(tmp / "spool"))
            for lr in LRS:
                for seed in SEEDS:
                    run = f"sweep-lr{lr:g}-s{seed}"
                    diverged[run], lrs[run] = train(server.url, run, SWEEP, lr, seed), lr
            for lr in (0.01, 0.1, 30.0, 100.0):
                for seed in SEEDS:
                    run = f"warm-lr{lr:g}-s{seed}"
                    diverged[run] = train(server.url, run, CONFOUNDED, lr, seed,
                                          warmup=lr * 100)
                    lrs[run] = lr
        server.wait_for_analysis()
        yield Sweeps(server, diverged, lrs)
    finally:
        server.stop()


def health(sweeps: Sweeps, project: str) -> dict:
    response = httpx.get(f"{sweeps.server.url}/api/v1/projects/{project}/health", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_sweep_itself_diverges_by_lr_not_by_seed(sweeps):
    """The setup the other tests stand on, from the losses alone."""
    sweep = {run: bad for run, bad in sweeps.diverged.items() if run.startswith("sweep-")}
    assert 0 < sum(sweep.values()) < len(sweep)
    for seed in SEEDS:  # every seed has runs on both sides
        assert {bad for run, bad in sweep.items() if run.endswith(f"-s{seed}")} == {True, False}


def test_the_api_names_lr_first_with_the_threshold_the_losses_draw(sweeps):
    body = health(sweeps, SWEEP)
    assert len(body["runs"]) == len(LRS) * len(SEEDS) and body["analysis_pending"] == 0
    top = body["factors"][0]
    assert top["key"] == "lr" and top["kind"] == "numeric" and top["separates"]
    above = {run["id"] for run in body["runs"] if sweeps.lr[run["id"]] >= top["threshold"]}
    truth = {run for run, bad in sweeps.diverged.items() if bad and run.startswith("sweep-")}
    assert above == truth
    assert top["score"] == 1.0 and top["verdict"] == "separates exactly"
    assert [(s["runs"], s["unhealthy"]) for s in top["sides"]] == [
        (len(truth), len(truth)), (len(body["runs"]) - len(truth), 0)]
    # every run's outcome and first bad step agree with its own losses
    for run in body["runs"]:
        assert (run["outcome"] != "healthy") == sweeps.diverged[run["id"]], run
        assert (run["first_bad_step"] is not None) == sweeps.diverged[run["id"]], run
    assert all(run["kinds"] for run in body["runs"] if sweeps.diverged[run["id"]])
    seed = next(f for f in body["factors"] if f["key"] == "seed")
    assert not seed["separates"] and seed["verdict"].startswith("does not separate")
    assert body["factors"].index(seed) > 0


def test_keys_that_move_together_are_flagged_as_confounded(sweeps):
    factors = {f["key"]: f for f in health(sweeps, CONFOUNDED)["factors"]}
    first = health(sweeps, CONFOUNDED)["factors"][0]
    assert first["key"] in ("lr", "warmup") and first["separates"]
    assert factors["lr"]["confounded_with"] == ["warmup"]
    assert factors["warmup"]["confounded_with"] == ["lr"]
    assert not factors["warmup"]["credited"]  # the same split is credited once
    assert "either may be the cause" in factors["lr"]["verdict"]


def test_the_api_filters_by_tag_and_is_in_openapi(sweeps):
    url = f"{sweeps.server.url}/api/v1/projects/{SWEEP}/health"
    assert httpx.get(url, params={"tag": "none such"}, timeout=30).json()["runs"] == []
    assert len(httpx.get(url, params={"tag": "sweep"}, timeout=30).json()["runs"]) == 14
    assert httpx.get(f"{sweeps.server.url}/api/v1/projects/nothing/health",
                     timeout=30).status_code == 404
    schema = httpx.get(f"{sweeps.server.url}/openapi.json", timeout=30).json()
    answer = schema["paths"]["/api/v1/projects/{project}/health"]["get"]["responses"]["200"]
    assert answer["content"]["application/json"]["schema"]["$ref"].endswith(
        "ProjectHealthPublic")


def test_the_cli_prints_the_ranking_as_a_table(sweeps, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: each factor on one line
    with Client(sweeps.server.url) as client:
        assert client.project_health(SWEEP).factors[0].key == "lr"
    out = StringIO()
    with redirect_stdout(out):
        assert main(["project", SWEEP, "--server", sweeps.server.url]) == 0
    text = out.getvalue()
    assert text.startswith(f"project {SWEEP}: 14 runs, ")
    first = text.split("Settings, best separating first:\n")[1].splitlines()[1]
    assert first.split()[:2] == ["1", "lr"] and "Separates exactly" in first


@pytest.mark.browser
def test_the_page_names_the_factor_and_draws_its_charts(sweeps, chromium, tmp_path):
    browser = open_browser(chromium, sweeps.server.url, tmp_path, width=1280)
    try:
        browser.goto(f"/projects/{SWEEP}")
        browser.wait_for_plots("chart-0", "chart-1")  # lr and seed: the rest hold one value
        rows = browser.page.locator("#factors tbody tr")
        assert rows.first.get_attribute("data-key") == "lr"
        assert "separates exactly" in rows.first.inner_text()
        outcomes = dict(browser.page.locator("#project-runs tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.runId, r.dataset.outcome])"))
        assert {run for run, outcome in outcomes.items() if outcome != "healthy"} == {
            run for run, bad in sweeps.diverged.items() if bad and run.startswith("sweep-")}
        traces = browser.traces("chart-0")
        assert sum(t["points"] for t in traces) == 14
        assert browser.page.evaluate(
            "document.getElementById('fig-chart-0')._fullLayout.xaxis.type") == "log"
        if os.environ.get("AMPWATCH_DOC_SHOTS"):  # docs/img/project.png, by hand
            browser.page.screenshot(path=str(DOCS_IMG / "project.png"), full_page=True)
        browser.shoot("project")

        browser.goto(f"/projects/{CONFOUNDED}")
        browser.wait_for_plots("chart-0")
        assert "confounded with" in browser.page.locator("#factors tbody tr").first.inner_text()
        # the runs list and a run page link to the project
        browser.goto("/")
        with browser.page.expect_navigation():
            browser.page.locator("tr[data-run-id='sweep-lr30-s0'] a.project-link").click()
        assert browser.page.url.endswith(f"/projects/{SWEEP}")
        browser.goto("/runs/sweep-lr30-s0")
        assert browser.page.locator(".run-head a.project-link").get_attribute(
            "href") == f"/projects/{SWEEP}"
        browser.assert_clean()
    finally:
        browser.page.context.close()
