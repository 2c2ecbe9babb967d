"""Fixtures of the client tests: a Client on the real app, seeded runs, and one live
server per module that the command line talks to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ampwatch.client import Client
from ampwatch.client.cli import main
from tests.conftest import LiveServer
from tests.utils import make_steps, post_batch, register_run

N_LAYERS = 4
ENVIRONMENT = {
    "autocast_dtype": "float16", "device": "cpu", "torch_version": "2.13.0",
    "scaler": {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
               "growth_interval": 2000, "enabled": True},
}


def seed_healthy(api: httpx.Client, run_id: str = "healthy", steps: int = 300,
                 project: str = "tests") -> None:
    """A run with no skipped steps: its only findings are informational."""
    register_run(api, run_id, N_LAYERS, environment=ENVIRONMENT, project=project)
    response = post_batch(api, run_id, 0, make_steps(0, steps, N_LAYERS, sample_every=10))
    assert response.status_code == 200, response.text


def seed_diverging(api: httpx.Client, run_id: str = "diverging") -> None:
    """A run whose GradScaler skips every step from 200 on (inf grads in layer 0):
    a critical, still open skip streak."""
    register_run(api, run_id, N_LAYERS, environment=ENVIRONMENT)
    steps = make_steps(0, 260, N_LAYERS, skipped=set(range(200, 260)), sample_every=10)
    response = post_batch(api, run_id, 0, steps)
    assert response.status_code == 200, response.text


@pytest.fixture
def client(api) -> Client:
    """The client on the real app (FastAPI's TestClient is an httpx.Client)."""
    return Client(http_client=api)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One `ampwatch serve` process per test module, seeded with a healthy and a
    diverging run; tests that change data use run ids of their own."""
    directory = tmp_path_factory.mktemp("server")
    live = LiveServer(f"sqlite:///{directory / 'live.db'}", directory / "server.log")
    live.start()
    with httpx.Client(base_url=live.url) as api:
        seed_healthy(api)
        seed_diverging(api)
    live.wait_for_analysis()  # the commands read the findings of what it was sent
    yield live
    live.stop()


@pytest.fixture
def server_api(server: LiveServer) -> Iterator[httpx.Client]:
    """Plain HTTP to the live server, for seeding test data."""
    with httpx.Client(base_url=server.url) as api:
        yield api


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def ampwatch(server: LiveServer, capsys: pytest.CaptureFixture) -> Callable[..., Result]:
    """Run `ampwatch ARGS... --server <live server>` through `client.cli.main`."""

    def run(*args: str | Path, server_url: str | None = None) -> Result:
        code = main([*map(str, args), "--server", server_url or server.url])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run
