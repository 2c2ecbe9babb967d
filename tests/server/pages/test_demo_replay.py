"""The run page's replay command for a demo run runs as shown: `ampwatch demo` trains on a
live server, Chromium reads the command the bundles panel prints, and a shell runs it on
a machine with nothing but the installed package: it replays the step the demo broke and
bisects to the layer the demo made overflow."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampwatch.client import Client
from ampwatch.demo.runs import SCENARIOS
from tests.conftest import LiveServer
from tests.server.pages.conftest import Browser, open_browser

pytestmark = pytest.mark.browser
OVERFLOW = next(s for s in SCENARIOS if s.overflow_layer)  # what the demo itself injects
STEPS = 60  # the least the demo accepts


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server holding the runs of a real `ampwatch demo --server URL`."""
    tmp = tmp_path_factory.mktemp("demo-replay")
    server = LiveServer(f"sqlite:///{tmp / 'demo.db'}", tmp / "server.log")
    server.start()
    try:
        env = {**os.environ, "XDG_DATA_HOME": str(tmp)}
        done = subprocess.run([sys.executable, "-m", "ampwatch.client.cli", "demo", "--server",
                               server.url, "--steps", str(STEPS)], capture_output=True,
                              text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        yield server
    finally:
        server.stop()


@pytest.fixture
def demo_browser(chromium, demo_server: LiveServer, tmp_path: Path) -> Iterator[Browser]:
    opened = open_browser(chromium, demo_server.url, tmp_path)
    yield opened
    opened.page.context.close()


def _shell(command: str, server: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user's shell runs it: `ampwatch` on the PATH, the server named by
    AMPWATCH_SERVER, in a folder that holds nothing of this repository."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "AMPWATCH_SERVER": server}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["/bin/sh", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_printed_replay_command_replays_the_demos_overflow(
        demo_browser: Browser, demo_server: LiveServer, tmp_path: Path) -> None:
    browser = demo_browser
    browser.goto(f"/runs/{OVERFLOW.run_id}")
    (command,) = browser.page.locator("#bundles code.command.replay").all_inner_texts()
    assert "MODULE:FACTORY" not in command
    assert browser.page.locator("#bundles", has_text="the run recorded none").count() == 0
    browser.assert_clean()

    done = _shell(command, demo_server.url, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "reproduced: yes" in out
    assert f"first non-finite layer {OVERFLOW.overflow_layer}, grads finite False" in out
    kept = out.split("bisect: keeping ", 1)[1].split(" in float32 makes the step finite")[0]
    assert OVERFLOW.overflow_layer in kept.split(", "), out
    with Client(demo_server.url) as client:  # the bisect's verdict went back with the bundle
        (bundle,) = client.bundles(OVERFLOW.run_id)
    assert bundle.bisect.verdict == "fixed"
    assert OVERFLOW.overflow_layer in bundle.bisect.modules


def test_only_the_run_the_demo_broke_has_a_bundle_to_replay(demo_browser: Browser) -> None:
    browser = demo_browser
    for scenario in SCENARIOS:
        browser.goto(f"/runs/{scenario.run_id}")
        assert browser.page.locator("#bundles").count() == (scenario is OVERFLOW)
    browser.assert_clean()
