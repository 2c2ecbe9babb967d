"""Schemathesis against the OpenAPI schema, with every check it has: no 5xx, every status,
content type, header and body as the schema documents them, schema-valid requests
accepted and schema-violating ones refused, the Allow header of a 405, and (with a token
set) no route that takes a request without it. On SQLite with AMPWATCH_TOKEN set, and on
Postgres without one when AMPWATCH_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.core.parameters import ParameterLocation  # noqa: E402

from ampwatch.server.app import close_app, create_app  # noqa: E402
from ampwatch.server.settings import Settings  # noqa: E402
from tests.conftest import fresh_database_url, judged_client  # noqa: E402
from tests.utils import make_steps, register_run  # noqa: E402

TOKEN = "fuzz-token"
# CI runs one fixed sample, so an input first drawn later cannot fail an unrelated change;
# AMPWATCH_FUZZ_EXAMPLES=500 explores further with fresh random inputs
EXAMPLES = int(os.environ.get("AMPWATCH_FUZZ_EXAMPLES", "0"))


@pytest.fixture(scope="module",
                params=["sqlite-token", pytest.param("postgres", marks=pytest.mark.postgres)])
def fuzz_app(request, tmp_path_factory):
    backend = request.param.removesuffix("-token")
    url = fresh_database_url(request, backend, tmp_path_factory.mktemp("fuzz"))
    token = TOKEN if request.param.endswith("-token") else None
    app = create_app(Settings(database_url=url, token=token))
    with judged_client(app, headers=auth_headers(app)) as client:  # data for reads to read
        register_run(client, "r1", n_layers=4)
        client.post("/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 0, "steps": make_steps(0, 50, 4, skipped={5},
                                                                   sample_every=5)})
    yield app
    close_app(app)


schema = schemathesis.pytest.from_fixture("fuzz_schema")


# A batch whose per-layer vectors do not match its run's layer table is answered 422 (the
# agent drops it: resending cannot help). The schema cannot know a run's table, so a
# schema-valid batch may earn that 422; every other answer keeps the check's defaults.
BATCH_STATE_CHECK = {
    "include-path": "/api/v1/runs/{run_id}/batches", "include-method": "POST",
    "checks": {"positive_data_acceptance": {"expected-statuses": [
        *SchemathesisConfig().projects.default.checks.positive_data_acceptance
        .expected_statuses, "422"]}},
}


# A heartbeat's step beyond what its rank can have trained since its last batch is answered
# 422 (docs/security.md): the schema cannot know the rank's pace
HEARTBEAT_PACE_CHECK = {
    "include-path": "/api/v1/runs/{run_id}/ranks/{rank}/reached", "include-method": "POST",
    "checks": {"positive_data_acceptance": {"expected-statuses": [
        *SchemathesisConfig().projects.default.checks.positive_data_acceptance
        .expected_statuses, "422"]}},
}


# A bundle upload is a zip file whose bundle.json must name the step in the path: bytes the
# schema can only call binary, so a schema-valid body may earn a 422 too (docs/replay.md)
BUNDLE_CONTENT_CHECK = {
    "include-path": "/api/v1/runs/{run_id}/bundles/{rank}/{step}", "include-method": "PUT",
    "checks": {"positive_data_acceptance": {"expected-statuses": [
        *SchemathesisConfig().projects.default.checks.positive_data_acceptance
        .expected_statuses, "422"]}},
}


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    config = SchemathesisConfig.from_dict({"operations": [BATCH_STATE_CHECK,
                                                          HEARTBEAT_PACE_CHECK,
                                                          BUNDLE_CONTENT_CHECK]})
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app, config=config,
                                          headers=auth_headers(fuzz_app))


def auth_headers(app) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"} if app.state.settings.token else {}


def follow_cross_field_rules(case) -> None:
    """Give a schema-valid body the two rules JSON Schema cannot state (server/schemas.py):
    a batch's steps strictly increase and a run's layer indices are 0..L-1. The server
    answers 422 without them, which the positive_data_acceptance check would flag."""
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.BODY):
        return
    body = case.body
    if not isinstance(body, dict):
        return
    steps = body.get("steps")
    if isinstance(steps, list) and all(isinstance(s, dict) and "step" in s for s in steps):
        by_step = {s["step"]: s for s in steps}
        body["steps"] = [by_step[step] for step in sorted(by_step)]
    layers = body.get("layers")
    if isinstance(layers, list):
        for index, layer in enumerate(layers):
            layer["index"] = index
    case.body = body


@schema.parametrize()
@settings(max_examples=EXAMPLES or 25, derandomize=not EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_the_server_does_what_its_schema_says(case, fuzz_app):
    follow_cross_field_rules(case)
    case.call_and_validate(headers=auth_headers(fuzz_app))  # every check schemathesis has
