"""Pages over HTTP on the real app: each JSON twin is the API's query answer, long runs
are downsampled, names are escaped, and a token-protected server sends browsers to
the login form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from tests.conftest import judged_client
from tests.utils import make_steps, post_batch, register_run

XSS = "<script>alert(1)</script>"


@pytest.fixture
def long_run(api):
    register_run(api, "long", n_layers=4, name=XSS, project=XSS)
    skipped = {5, 1234, 4321}
    for seq, first in enumerate(range(0, 6000, 1000)):
        response = post_batch(api, "long", seq, make_steps(first, 1000, 4, skipped=skipped,
                                                           sample_every=10))
        assert response.status_code == 200, response.text
    return skipped


def test_overview_twin_is_the_downsampled_steps_query(api, long_run):
    twin = api.get("/runs/long?format=json").json()
    assert twin["steps"] == api.get("/api/v1/runs/long/steps?max_points=2000").json()
    assert twin["steps"]["total"] == 6000 and twin["steps"]["downsampled"]
    assert twin["steps"]["count"] <= 2000
    assert {item["step"] for item in twin["steps"]["events"]} == long_run
    assert twin["run"]["name"] == XSS
    assert {"open", "resolved"} == set(twin["findings"])


def test_layers_twin_is_the_matrix_and_layers_queries(api, long_run):
    twin = api.get("/runs/long/layers?format=json").json()
    assert twin["grad_norm"] == api.get("/api/v1/runs/long/layers/matrix?buckets=1000").json()
    assert twin["act_absmax"] == api.get(
        "/api/v1/runs/long/layers/matrix?metric=act_absmax&buckets=1000").json()
    assert twin["layers"] == api.get("/api/v1/runs/long/layers").json()


def test_compare_and_runs_twins(api, long_run):
    twin = api.get("/compare?run=long&run=missing-run&format=json").json()
    assert [run["id"] for run in twin["runs"]] == ["long"]
    assert twin["missing"] == ["missing-run"]
    runs = api.get("/?format=json&project=" + XSS).json()
    assert [run["id"] for run in runs["items"]] == ["long"]


def test_live_update_answers_figures_and_panels(api, long_run):
    update = api.get("/runs/long?format=update").json()
    # no peak memory in these steps: no memory chart
    assert set(update["figures"]) == {"loss_scale", "grad_norm", "loss", "lr", "phases"}
    assert set(update["panels"]) == {"run-stats", "run-status", "findings", "steps-footer"}
    assert update["live"] is True


@pytest.mark.parametrize("path", ["/runs/long", "/runs/long/layers", "/compare?run=long"])
def test_a_page_embeds_the_figures_its_live_update_draws(api, long_run, path):
    html = api.get(path).text
    opening = '<script type="application/json" id="figures">'
    start = html.index(opening) + len(opening)
    embedded = html[start:html.index("</script>", start)]
    assert not {"<", ">", "&"} & set(embedded)  # nothing in it can end the script tag
    update = api.get(path + ("&" if "?" in path else "?") + "format=update").json()
    assert json.loads(embedded) == update["figures"] != {}


@pytest.mark.parametrize("path", ["/", "/runs/long", "/runs/long/layers",
                                  "/compare?run=long"])
def test_pages_escape_names_and_embed_no_raw_markup(api, long_run, path):
    response = api.get(path)
    assert response.status_code == 200
    assert "<script>alert" not in response.text
    assert "script-src 'self'" in response.headers["content-security-policy"]


def test_unknown_run_is_an_html_404(api):
    response = api.get("/runs/no-such-run")
    assert response.status_code == 404
    assert "no run with id" in response.text


def test_pages_need_the_token_and_the_login_form_sets_a_strict_cookie(database_url):
    app = create_app(Settings(database_url=database_url, token="s3cret"))
    try:
        with judged_client(app, follow_redirects=False) as client:
            redirect = client.get("/runs/x?rank=1")
            assert redirect.status_code == 303
            assert redirect.headers["location"] == "/login?next=%2Fruns%2Fx%3Frank%3D1"
            wrong = client.post("/login", data={"token": "nope", "next": "/"})
            assert wrong.status_code == 401
            assert "set-cookie" not in wrong.headers
            offsite = client.post("/login", data={"token": "s3cret", "next": "//evil.test/"})
            assert offsite.headers["location"] == "/"
            login = client.post("/login", data={"token": "s3cret", "next": "/compare"})
            assert login.status_code == 303 and login.headers["location"] == "/compare"
            cookie = login.headers["set-cookie"]
            assert "ampwatch_token=s3cret" in cookie
            assert "HttpOnly" in cookie and "SameSite=strict" in cookie
            client.cookies.set("ampwatch_token", "s3cret")
            assert client.get("/").status_code == 200
            assert client.get("/api/v1/runs").status_code == 200
    finally:
        close_app(app)


@pytest.mark.parametrize("path", ["/runs/long", "/runs/long/layers", "/runs/long/layers/0",
                                  "/runs/long/fp8"])
def test_a_reversed_step_range_is_refused(api, long_run, path):
    response = api.get(path + "?start=300&end=100&format=json")
    assert response.status_code == 422
    assert "before it starts" in response.text
    assert api.get(path + "?start=100&end=100&format=json").status_code == 200


def test_the_runs_twin_filters_by_tag_and_sorts_by_a_column(api):
    for run_id, count, tags in (("t1", 30, ["a", "ünï"]), ("t2", 10, ["ünï"]),
                                ("t3", 20, ["b"])):
        register_run(api, run_id, n_layers=2, tags=tags)
        assert post_batch(api, run_id, 0, make_steps(0, count, 2)).status_code == 200

    def ids(query: str) -> list[str]:
        return [r["id"] for r in api.get(f"/?format=json&{query}").json()["items"]]

    assert ids("tag=ünï") == ["t2", "t1"]
    assert ids("tag=a") == ["t1"] and ids("tag=%22") == []
    assert ids("sort=-last_step") == ["t1", "t3", "t2"]
    assert ids("sort=last_step&tag=ünï") == ["t2", "t1"]
    assert ids("sort=name") == ["t1", "t2", "t3"]
    assert api.get("/?format=json&sort=bogus").status_code == 422


def test_a_time_axis_gives_each_step_its_time_summed_over_every_stored_step(api):
    """?x=relative: each drawn step's elapsed_ms is the running sum of t_step_ms over every
    stored step from the first (not only over the downsampled points, not only from the
    zoom's start); steps that never arrived add nothing."""
    register_run(api, "timed", n_layers=2)
    stored = [s for s in make_steps(0, 5000, 2, skipped={77}) if not 2000 <= s["step"] < 2500]
    for step in stored:
        step["t_step_ms"] = 10.0 + step["step"] % 13
    for seq, first in enumerate(range(0, len(stored), 1000)):
        assert post_batch(api, "timed", seq, stored[first:first + 1000]).status_code == 200
    running = np.cumsum([0.0] + [s["t_step_ms"] for s in stored[1:]])
    expected = dict(zip([s["step"] for s in stored], running.tolist(), strict=True))
    for query in ("x=relative", "x=wall&start=3000"):
        twin = api.get(f"/runs/timed?format=json&{query}").json()["steps"]
        rows = twin["items"] + twin["events"]
        assert twin["downsampled"] or "start" in query
        assert {row["step"] for row in twin["events"]} == ({77} if "start" not in query
                                                           else set())
        assert all(row["elapsed_ms"] == expected[row["step"]] for row in rows)
    assert "elapsed_ms" not in api.get("/runs/timed?format=json").json()["steps"]["items"][0]
