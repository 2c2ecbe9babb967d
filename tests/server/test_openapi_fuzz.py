"""Schemathesis against the OpenAPI schema: no input makes the server answer 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from ampwatch.server.app import create_app  # noqa: E402
from ampwatch.server.settings import Settings  # noqa: E402
from tests.utils import make_steps, register_run  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    app = create_app(Settings(database_url=f"sqlite:///{db}"))
    from fastapi.testclient import TestClient

    with TestClient(app) as client:  # some real data so reads have something to read
        register_run(client, "r1", n_layers=4)
        client.post("/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 0, "steps": make_steps(0, 50, 4, skipped={5},
                                                                   sample_every=5)})
    yield app
    app.state.engine.dispose()


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


@schema.parametrize()
@settings(max_examples=25, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error])
