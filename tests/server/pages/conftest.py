"""Page test fixtures: one real server per module filled by real CPU training through
the agent, and headless Chromium (Debian's, via Playwright) that may only talk to it."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from ampwatch.server.pages import figures
from tests.conftest import LiveServer
from tests.server.pages.training import GrowingGain, Net, Trainer, mlp

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHOTS = Path("/tmp/ampwatch-shots")
XSS = "<script>alert(1)</script>"
XSS_PROJECT = "<img src=x onerror=alert(2)>"
XSS_LAYER = "<img src=y onerror=alert(3)>"


class XssNet(Net):
    """A model with a layer whose name is markup (torch allows it)."""

    def __init__(self) -> None:
        super().__init__(seed=3, norm=False)
        self.add_module(XSS_LAYER, torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, XSS_LAYER)(super().forward(x))


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server holding four real training runs: healthy fp16, fp16 diverging
    because blocks.3.fc overflows in the forward (with misaligned 100-wide layers and a
    LayerNorm run in fp16), bf16 without a scaler, and one whose names are markup."""
    tmp = tmp_path_factory.mktemp("dashboard")
    server = LiveServer(f"sqlite:///{tmp / 'live.db'}", tmp / "server.log")
    server.start()
    # a spool of its own: each module that asks for it trains the same run ids again
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMPWATCH_SPOOL_DIR", str(tmp / "spool"))
        try:
            Trainer(server.url, "healthy-fp16", "healthy fp16", Net(seed=0, norm=False),
                    tags=["fp16"]).train(150).close()
            Trainer(server.url, "diverging-fp16", "diverging fp16",
                    Net(seed=1, width=100, boom=1e6), tags=["fp16"]).train(60).close()
            Trainer(server.url, "bf16-run", "bf16 run", Net(seed=2), dtype=torch.bfloat16,
                    tags=["bf16"]).train(60).close()
            Trainer(server.url, "xss-run", XSS, XssNet(), project=XSS_PROJECT,
                    tags=[XSS]).train(20).close()
            server.wait_for_analysis()  # the pages tell the findings of all it was sent
            yield server
        finally:
            server.stop()


GROWING_LAYER = "6"  # the Linear of the fp16 run whose gain grows 2.5% a step
FIELD_STEPS = 500


@dataclass(frozen=True)
class FieldRuns:
    """The two runs issue #35 was found on, trained for real on the CPU, and what the
    test's own hooks saw: the step the growing layer's fp16 output first held inf/NaN."""

    server: LiveServer
    first_overflow: int  # growing-fp16: first step layer GROWING_LAYER's output was inf/NaN
    scales: list[float]  # growing-fp16: the loss scale each step ran with
    steps: int = FIELD_STEPS
    # growing-fp16: the steps layer GROWING_LAYER's output held inf/NaN, by the test's hook
    output_nonfinite_steps: int = 0


@pytest.fixture(scope="session")
def field_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FieldRuns]:
    """A live server holding "growing-fp16" (a 6-Linear nn.Sequential MLP in fp16 autocast
    with a GradScaler, whose layer "6" has a gain on its output that grows 2.5% a step
    until the output overflows fp16, about step 400) and "sgd-bf16" (the same MLP
    in bf16 autocast trained with plain SGD at lr=30: it diverges from its first steps).
    About 5 s of training; shared by every page test that needs them."""
    tmp = tmp_path_factory.mktemp("field")
    server = LiveServer(f"sqlite:///{tmp / 'field.db'}", tmp / "server.log")
    server.start()
    try:
        model = mlp(seed=0)
        growth = GrowingGain(model, GROWING_LAYER, start=8.0)  # overflows near step 400
        # every output of every step checked: the layers page counts the steps whose output
        # held inf/NaN, including those whose inf the ReLU after it absorbed (loss finite)
        growing = Trainer(server.url, "growing-fp16", "growing fp16", model,
                          after_step=growth, tags=["fp16"], check_outputs="every_step")
        growing.train(FIELD_STEPS).close()
        assert growth.first_nonfinite is not None, "layer 6 never overflowed"
        Trainer(server.url, "sgd-bf16", "sgd lr=30 bf16", mlp(seed=1), dtype=torch.bfloat16,
                lr=30.0, sgd=True, tags=["bf16"]).train(150).close()
        server.wait_for_analysis()
        yield FieldRuns(server=server, first_overflow=growth.first_nonfinite,
                        scales=growing.scales,
                        output_nonfinite_steps=int((~np.isfinite(growth.absmax)).sum()))
    finally:
        server.stop()


@dataclass
class Browser:
    """A Chromium page that records console errors, uncaught exceptions, dialogs and
    every request that would leave the server (those are aborted)."""

    page: object
    base_url: str
    shots: Path
    errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def goto(self, path: str) -> None:
        self.page.goto(self.base_url + path)
        self.page.wait_for_load_state("networkidle")

    def wait_for_plots(self, *names: str) -> None:
        for name in names:
            self.page.wait_for_selector(f"#fig-{name} svg.main-svg", state="attached")

    def traces(self, name: str) -> list[dict]:
        """Name, type and point count of each trace Plotly drew in #fig-<name>
        (`_fullData`: the traces after Plotly decoded their typed arrays)."""
        return self.page.evaluate(
            """(id) => document.getElementById(id)._fullData.map(t => ({
                name: t.name, type: t.type, points: t.x ? t.x.length : 0}))""",
            f"fig-{name}")

    def x_values(self, name: str, trace: int = 0) -> list[float]:
        """The x values of a drawn trace (Plotly has decoded the base64 arrays)."""
        return self.page.evaluate(
            "([id, i]) => Array.from(document.getElementById(id)._fullData[i].x)",
            [f"fig-{name}", trace])

    def lines(self, name: str) -> list[list[float]]:
        """The y values of each line of #fig-<name> as drawn (smoothed, when it is)."""
        return self.page.evaluate(
            """(id) => document.getElementById(id)._fullData
                .filter(t => t.type === 'scatter' && t.mode.includes('lines'))
                .map(t => Array.from(t.y))""", f"fig-{name}")

    def smooth(self, name: str, weight: float, raw: list[list[float]]) -> list[list[float]]:
        """Move #fig-<name>'s smoothing slider to `weight` and check each line now draws
        the server's EMA (figures.smooth) of its `raw` values; the lines drawn."""
        self.page.locator(f".chart-tools[data-for='fig-{name}'] .smoothing").fill(str(weight))
        drawn = self.lines(name)
        for raw_line, line in zip(raw, drawn, strict=True):
            expected = figures.smooth(np.array(raw_line), weight).tolist()
            assert all(math.isclose(a, b, rel_tol=1e-9)
                       for a, b in zip(line, expected, strict=True))
            assert weight == 0 or line != raw_line
        return drawn

    def log_axis(self, name: str, on: bool) -> None:
        """Tick or clear #fig-<name>'s log toggle and wait for its y axis to follow."""
        toggle = self.page.locator(f".chart-tools[data-for='fig-{name}'] .log-axis")
        toggle.check() if on else toggle.uncheck()
        self.page.wait_for_function(
            f"document.getElementById('fig-{name}')._fullLayout.yaxis.type === "
            f"'{'log' if on else 'linear'}'")

    def shoot(self, name: str) -> Path:
        """A full-page screenshot in the test's temp dir, copied to /tmp/ampwatch-shots."""
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, SHOTS / path.name)
        return path

    def assert_clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.outside == [], self.outside
        assert self.dialogs == [], self.dialogs


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_browser(chromium, base_url: str, shots: Path, width: int = 1366) -> Browser:
    context = chromium.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    browser = Browser(page=page, base_url=base_url, shots=shots)
    page.on("console", lambda msg: browser.errors.append(msg.text)
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: browser.errors.append(str(exc)))

    def on_dialog(dialog) -> None:
        browser.dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)

    def guard(route) -> None:
        url = route.request.url
        if url == base_url or url.startswith(base_url + "/"):
            route.continue_()
        else:
            browser.outside.append(url)
            route.abort()

    page.route("**/*", guard)
    return browser


@pytest.fixture
def field_browser(chromium, field_runs: FieldRuns, tmp_path: Path) -> Iterator[Browser]:
    """A fresh browser context on the field runs' server."""
    opened = open_browser(chromium, field_runs.server.url, tmp_path)
    yield opened
    opened.page.context.close()


@pytest.fixture
def browser(chromium, dashboard: LiveServer, tmp_path: Path) -> Iterator[Browser]:
    """A fresh browser context on the dashboard server; checks it stayed clean."""
    opened = open_browser(chromium, dashboard.url, tmp_path)
    yield opened
    opened.page.context.close()
