"""The zoo's fixtures: the agent's (offline spool per test, errors the guard swallowed fail
the test, one torch thread, syncing Tensor calls counted) and one live server per module
for the findings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.agent.conftest import _one_thread, agent_errors, attach, offline, spool_dir
from tests.agent.test_hot_path import sync_calls
from tests.conftest import LiveServer, module_server

__all__ = ["_one_thread", "agent_errors", "attach", "offline", "spool_dir", "sync_calls"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "zoo")
