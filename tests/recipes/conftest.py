"""Recipe fixtures: one real server for the whole suite (each test makes its own runs),
one torch thread, and a guard that turns what the agent swallowed into a failure."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ampwatch.client import Client
from tests.conftest import LiveServer, agent_errors_fail, module_server


@pytest.fixture(scope="session")
def recipe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "recipes")


@pytest.fixture
def client(recipe_server: LiveServer) -> Iterator[Client]:
    with Client(recipe_server.url) as made:
        yield made


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield
