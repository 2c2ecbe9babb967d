"""Requests of odd shapes, answered as documented on SQLite and Postgres: NUL in any query
parameter (422, never a 500 from Postgres), wrong methods (405 with Allow filled), names
with control or invisible formatting characters (422), and /health's reason kept from
those without the token."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from tests.conftest import judged_client
from tests.utils import make_layers, make_steps, post_batch, register_run

NUL_QUERIES = [
    "/compare?run=a%00b", "/compare?run=a%00b&format=json", "/api/v1/runs?project=x%00",
    "/api/v1/runs?tag=%00", "/runs/r1?format=json&x%00=1", "/api/v1/runs/r1/findings?kind=a%00",
    "/?q=%00", "/runs/r1/layers?layer=%00&format=json",
]


@pytest.mark.parametrize("path", NUL_QUERIES)
def test_nul_in_any_query_parameter_is_422(api, path):
    register_run(api, "r1")
    response = api.get(path)
    assert response.status_code == 422, response.text[:300]
    assert "NUL" in response.text and len(response.content) < 2000


WRONG_METHODS = [
    ("PATCH", "/api/v1/runs", {"GET"}), ("DELETE", "/api/v1/runs/r1/batches", {"POST"}),
    ("POST", "/api/v1/health", {"GET"}), ("PUT", "/", {"GET"}),
    ("DELETE", "/static/plotly.min.js", {"GET"}), ("PUT", "/login", {"GET", "POST"}),
    ("POST", "/api/v1/runs/r1", {"GET", "PUT", "DELETE"}), ("PUT", "/metrics", {"GET"}),
]


@pytest.mark.parametrize(("method", "path", "allowed"), WRONG_METHODS)
def test_a_wrong_method_names_the_right_ones(api, method, path, allowed):
    response = api.request(method, path, headers={"content-type": "application/json"})
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) >= allowed, response.headers["allow"]
    assert all(m in {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"}
               for m in response.headers["allow"].split(", "))


HIDDEN = {
    "carriage return": "layer\r\nSubject: hi", "right-to-left override": "gpt\u202etxt.exe",
    "zero-width space": "enc\u200bder", "zero-width joiner": "a\u200db", "C1 control": "a\x85b",
    "bidi isolate": "a\u2066b\u2069", "byte order mark": "\ufeffrun", "line separator": "a\u2028b",
    "left-to-right mark": "a\u200eb", "soft hyphen": "pass\u00adword",
}


@pytest.mark.parametrize("name", list(HIDDEN.values()), ids=list(HIDDEN))
def test_names_with_hidden_characters_are_422(api, name):
    for field, body in [("name", {"name": name}), ("project", {"project": name}),
                        ("tags", {"tags": ["ok", name]}),
                        ("layers", {"layers": [{"index": 0, "name": name, "type": "Linear"}]}),
                        ("layers", {"layers": [{"index": 0, "name": "fc", "type": name}]})]:
        response = api.put("/api/v1/runs/r1", json=body)
        assert response.status_code == 422, (field, response.text)
        assert "U+" in response.text, response.text
    assert api.get("/api/v1/runs/r1").status_code == 404  # nothing stored
    register_run(api, "r1", n_layers=2)
    response = post_batch(api, "r1", 0, make_steps(0, 1, 2),
                          events=[{"step": 0, "kind": name, "detail": {}}])
    assert response.status_code == 422


def test_names_people_write_are_taken(api):
    names = ["résumé run", "日本語モデル", "emoji 🚀 run", "a/b:c=d (x) [y] {z}", "Ελληνικά"]
    for i, name in enumerate(names):
        layers = make_layers(1)
        layers[0]["name"] = name
        assert api.put(f"/api/v1/runs/r{i}", json={"name": name, "project": name,
                                                   "tags": [name], "layers": layers}
                       ).status_code == 200, name
        assert api.get(f"/api/v1/runs/r{i}").json()["name"] == name


TOKEN = "health-s3cret"


@pytest.fixture
def unreachable_database_api(tmp_path):
    """A server whose Postgres is down (nothing listens on port 1), with a token set."""
    settings = Settings(database_url="postgresql+psycopg://ampwatch:pw@127.0.0.1:1/secretdb",
                        migrate_on_start=False, token=SecretStr(TOKEN))
    app = create_app(settings)
    with judged_client(app) as client:
        yield client
    close_app(app)


def test_health_keeps_database_details_from_those_without_the_token(unreachable_database_api):
    api = unreachable_database_api
    anonymous = api.get("/api/v1/health")
    assert anonymous.status_code == 503 and anonymous.json()["status"] == "degraded"
    for detail in ("127.0.0.1", "secretdb", "ampwatch", ":1", "port 1"):
        assert detail not in anonymous.text, detail
    assert "cannot be used" in anonymous.json()["reason"]
    insider = api.get("/api/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert insider.status_code == 503 and "127.0.0.1" in insider.json()["reason"]
