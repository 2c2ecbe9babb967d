"""Fixtures of the ground-truth suites: one live server per module, and agent errors
that fail the test instead of being swallowed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ampwatch.agent import guard
from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("faults")
    live = LiveServer(f"sqlite:///{root / 'faults.db'}", root / "server.log")
    live.start()
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    torch.set_num_threads(1)
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(tmp_path / "spool"))
    swallowed: list = []
    guard.set_error_handler(lambda site, exc: swallowed.append((site, exc)))
    yield
    guard.set_error_handler(None)
    if swallowed:
        site, exc = swallowed[0]
        raise AssertionError(f"agent swallowed an error in {site}") from exc
