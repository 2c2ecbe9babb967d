"""Optional bearer-token auth."""

from __future__ import annotations

import pytest

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from tests.conftest import judged_client


@pytest.fixture
def token_api(settings):
    app = create_app(Settings(database_url=settings.database_url, token="s3cret"))
    with judged_client(app) as client:
        yield client
    close_app(app)


@pytest.mark.parametrize("method, path", [
    ("get", "/api/v1/runs"), ("get", "/api/v1/runs/r1"), ("put", "/api/v1/runs/r1"),
    ("post", "/api/v1/runs/r1/batches"), ("get", "/api/v1/runs/r1/steps"),
    ("delete", "/api/v1/runs/r1"), ("get", "/api/v1/findings"),
])
def test_every_api_call_needs_the_token(token_api, method, path):
    response = token_api.request(method, path, json={} if method in ("put", "post") else None)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    wrong = token_api.request(method, path, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_the_right_token_passes(token_api):
    auth = {"Authorization": "Bearer s3cret"}
    assert token_api.put("/api/v1/runs/r1", json={}, headers=auth).status_code == 200
    assert token_api.get("/api/v1/runs", headers=auth).json()["total"] == 1
    token_api.cookies.set("ampwatch_token", "s3cret")
    assert token_api.get("/api/v1/runs").status_code == 200


def test_health_is_open_for_load_balancers(token_api):
    assert token_api.get("/api/v1/health").status_code == 200


def test_without_a_token_setting_everything_is_open(api):
    assert api.get("/api/v1/runs").status_code == 200
