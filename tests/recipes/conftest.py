"""Recipe fixtures: one real server for the whole suite (each test makes its own runs),
one torch thread, and a guard that turns what the agent swallowed into a failure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ampwatch.agent import guard
from ampwatch.client import Client
from tests.conftest import LiveServer


@pytest.fixture(scope="session")
def recipe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("recipes")
    live = LiveServer(f"sqlite:///{root / 'recipes.db'}", root / "server.log")
    live.start(timeout=120)  # a loaded CI machine can take a while to import the server
    yield live
    live.stop()


@pytest.fixture
def client(recipe_server: LiveServer) -> Iterator[Client]:
    with Client(recipe_server.url) as made:
        yield made


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test(tmp_path: Path) -> Iterator[None]:
    torch.set_num_threads(1)
    swallowed: list[tuple[str, BaseException]] = []
    guard.set_error_handler(lambda site, exc: swallowed.append((site, exc)))
    yield
    guard.set_error_handler(None)
    if swallowed:
        site, exc = swallowed[0]
        raise AssertionError(f"agent swallowed an error in {site}") from exc
