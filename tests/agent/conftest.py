"""Agent test fixtures: one torch thread, an offline spool per test, and a guard that
turns every error the agent swallowed back into a test failure."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ampwatch import agent
from tests.conftest import LiveServer, agent_errors_fail

SERVER_TOKEN = "s3cret-token"  # `token_server`'s


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def agent_errors() -> Iterator[list[tuple[str, BaseException]]]:
    """Collects what the guard swallowed; the test fails with the first one."""
    with agent_errors_fail() as swallowed:
        yield swallowed


@pytest.fixture(params=["host", "device"])
def reduction(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test both ways statistics are reduced: on the worker from host tensors (what
    the CPU does) and on the device into the step buffer (what CUDA does), here on CPU."""
    if request.param == "device":
        monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    return request.param


@pytest.fixture
def spool_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "spool"
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(path))
    return path


@pytest.fixture
def offline(spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """AMPWATCH_MODE=offline with a per-test spool; returns the spool root."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    return spool_dir


@pytest.fixture
def attach(offline: Path) -> Iterator[Callable[..., agent.Attachment]]:
    """`agent.attach` in offline mode; every attachment is detached at teardown."""
    made: list[agent.Attachment] = []

    def make(*args: Any, **kwargs: Any) -> agent.Attachment:
        attachment = agent.attach(*args, **kwargs)
        made.append(attachment)
        return attachment

    yield make
    for attachment in made:
        attachment.detach(timeout=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server process for the module (starting one costs seconds on a busy machine);
    a module may define its own."""
    home = tmp_path_factory.mktemp("server")
    live = LiveServer(f"sqlite:///{home / 'live.db'}", home / "server.log")
    live.start()
    yield live
    if live.process is not None:
        live.process.send_signal(signal.SIGCONT)  # in case a test died while it was stopped
    live.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server that takes `SERVER_TOKEN` only."""
    home = tmp_path_factory.mktemp("token")
    live = LiveServer(f"sqlite:///{home / 'live.db'}", home / "server.log",
                      env={"AMPWATCH_TOKEN": SERVER_TOKEN})
    live.start()
    yield live
    live.stop()
