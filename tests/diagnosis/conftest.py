"""Fixtures of the ground-truth suites: one live server per module, and agent errors
that fail the test instead of being swallowed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import LiveServer, agent_errors_fail, module_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "faults")


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield
