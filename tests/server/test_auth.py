"""Optional bearer-token auth."""

from __future__ import annotations

import re

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


# what answers without the token when one is set (docs/security.md, "What answers without
# the token"): path prefix -> methods; every other route refuses
PUBLIC = {"/api/v1/health": {"GET", "HEAD"}, "/login": {"GET", "HEAD", "POST"},
          "/logout": {"POST"}, "/static": {"GET", "HEAD"},
          "/static-offline-docs": {"GET", "HEAD"}}


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route and mount of the app, path parameters filled in."""
    found = []
    for route in app.routes:
        # FastAPI keeps an included router as one entry; its routes are its contexts
        for each in getattr(route, "effective_route_contexts", lambda r=route: [r])():
            path = re.sub(r"\{[^}]+\}", "1", each.path)
            methods = getattr(getattr(each, "original_route", each), "methods", None)
            if methods is None:  # a mount of static files
                path, methods = f"{path}/swagger-ui.css", {"GET", "HEAD"}
            found += [(method, path) for method in methods]
    return found


def _public(method: str, path: str) -> bool:
    return any((path == prefix or path.startswith(prefix + "/")) and method in methods
               for prefix, methods in PUBLIC.items())


def test_every_route_but_the_documented_public_ones_needs_the_token(token_api):
    routes = _routes(token_api.app)
    assert {"/docs", "/redoc", "/openapi.json"} <= {path for _, path in routes}
    open_without = []
    for method, path in routes:
        response = token_api.request(method, path, follow_redirects=False)
        to_login = (response.status_code == 303
                    and response.headers["location"].startswith("/login?next="))
        # the token check's 401 (the login form's own 401 for a wrong token is an answer)
        refused = to_login or (response.status_code == 401
                               and response.headers.get("www-authenticate") == "Bearer")
        if refused == _public(method, path):
            open_without.append((method, path, response.status_code))
    assert open_without == [], open_without


def test_the_api_docs_answer_with_the_token(token_api):
    token_api.cookies.set("ampwatch_token", "s3cret")  # the dashboard's login
    for path in ("/docs", "/redoc"):
        page = token_api.get(path, follow_redirects=False)
        assert page.status_code == 200 and "/openapi.json" in page.text
    assert token_api.get("/openapi.json").json()["info"]["title"] == "ampwatch"
    token_api.cookies.clear()
    bearer = {"Authorization": "Bearer s3cret"}
    assert token_api.get("/openapi.json", headers=bearer).status_code == 200
