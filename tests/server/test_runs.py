"""Run registration, listing, filtering, pagination and deletion."""

from __future__ import annotations

import pytest

from tests.utils import make_layers, make_steps, post_batch, register_run


def test_put_is_idempotent_and_updates_named_fields(api):
    first = register_run(api, "r1", n_layers=3, tags=["a"], config={"lr": 0.1})
    again = register_run(api, "r1", n_layers=3, tags=["a"], config={"lr": 0.1})
    assert first["created_at"] == again["created_at"] and again["n_layers"] == 3
    updated = api.put("/api/v1/runs/r1", json={"tags": ["b"]}).json()
    assert updated["tags"] == ["b"] and updated["config"] == {"lr": 0.1}
    assert updated["n_layers"] == 3  # layers untouched when not sent
    table = api.get("/api/v1/runs/r1/layers").json()["items"]
    assert [layer["name"] for layer in table] == [f"blocks.{i}.fc" for i in range(3)]


def test_environment_keeps_known_and_extra_keys(api):
    env = {"device": "cuda:0", "compute_capability": "7.0", "autocast_dtype": "bfloat16",
           "world_size": 8, "cluster": "east"}
    run = register_run(api, "r1", environment=env)
    assert run["environment"] == env


def test_layer_table_replaced_on_change(api):
    register_run(api, "r1", n_layers=3)
    api.put("/api/v1/runs/r1", json={"layers": make_layers(5)})
    assert api.get("/api/v1/runs/r1").json()["n_layers"] == 5
    assert len(api.get("/api/v1/runs/r1/layers").json()["items"]) == 5


@pytest.mark.parametrize("body, message", [
    ({"layers": [{"index": 1, "name": "a", "type": "Linear"}]}, "0..L-1"),
    ({"name": ""}, "at least 1"),
    ({"environment": {"world_size": 0}}, "greater than or equal to 1"),
])
def test_bad_run_bodies_get_422(api, body, message):
    response = api.put("/api/v1/runs/r1", json=body)
    assert response.status_code == 422 and message in response.text
    assert api.get("/api/v1/runs/r1").status_code == 404


def test_bad_run_id_is_rejected(api):
    assert api.put("/api/v1/runs/-bad", json={}).status_code == 422
    assert api.put("/api/v1/runs/" + "x" * 200, json={}).status_code == 422


def test_list_filters_and_paginates_newest_first(api):
    for i in range(5):
        register_run(api, f"run-{i}", project="alpha" if i % 2 else "beta")
    page = api.get("/api/v1/runs?limit=2").json()
    assert page["total"] == 5 and [r["id"] for r in page["items"]] == ["run-4", "run-3"]
    page2 = api.get("/api/v1/runs?limit=2&offset=2").json()
    assert [r["id"] for r in page2["items"]] == ["run-2", "run-1"]
    alpha = api.get("/api/v1/runs?project=alpha").json()
    assert {r["id"] for r in alpha["items"]} == {"run-1", "run-3"}
    assert api.get("/api/v1/runs?name=RUN-4").json()["total"] == 1
    assert api.get("/api/v1/runs?name=%25").json()["total"] == 0  # % is literal
    # registered, no step stored: never shown as healthy
    assert api.get("/api/v1/runs?status=no_data").json()["total"] == 5
    assert api.get("/api/v1/runs?status=healthy").json()["total"] == 0
    post_batch(api, "run-1", 0, make_steps(0, 3, 4))
    assert api.get("/api/v1/runs?status=healthy").json()["total"] == 1
    assert api.get("/api/v1/runs/run-1").json()["status"] == "healthy"
    assert api.get("/api/v1/runs/run-2").json()["status"] == "no_data"
    assert api.get("/api/v1/runs?status=critical").json()["total"] == 0
    assert api.get("/api/v1/runs?status=bogus").status_code == 422


def test_run_totals_and_live_flag(api):
    register_run(api, "r1")
    assert api.get("/api/v1/runs/r1").json()["live"] is False
    post_batch(api, "r1", 0, make_steps(0, 10, 4, skipped={3, 4}))
    run = api.get("/api/v1/runs/r1").json()
    assert (run["steps"], run["skipped"], run["last_step"], run["live"]) == (10, 2, 9, True)
    assert run["skip_rate"] == pytest.approx(0.2)


def test_a_run_whose_ranks_all_finished_is_not_live(api):
    register_run(api, "done")
    post_batch(api, "done", 0, make_steps(0, 10, 4), rank=0)
    post_batch(api, "done", 0, make_steps(0, 10, 4), rank=1)
    finished = [{"step": None, "kind": "finished", "detail": {}}]
    post_batch(api, "done", 1, make_steps(10, 5, 4), rank=0, events=finished)
    run = api.get("/api/v1/runs/done").json()
    assert (run["live"], run["finished"]) == (True, False)  # rank 1 still trains
    assert [r["finished_at"] is not None for r in run["ranks"]] == [True, False]
    post_batch(api, "done", 1, [], rank=1, events=finished)
    run = api.get("/api/v1/runs/done").json()
    assert (run["live"], run["finished"], run["steps"]) == (False, True, 25)
    listed = api.get("/api/v1/runs?name=done").json()["items"][0]
    assert (listed["live"], listed["finished"]) == (False, True)
    post_batch(api, "done", 2, make_steps(15, 5, 4), rank=0)  # resumed: trains again
    run = api.get("/api/v1/runs/done").json()
    assert (run["live"], run["finished"]) == (True, False)


def test_delete_removes_everything(api):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 10, 4))
    assert api.delete("/api/v1/runs/r1").status_code == 204
    assert api.get("/api/v1/runs/r1").status_code == 404
    assert api.delete("/api/v1/runs/r1").status_code == 404
    register_run(api, "r1")  # the id can be used again, with no old data
    assert api.get("/api/v1/runs/r1/steps").json()["items"] == []


def test_health(api, database_url):
    body = api.get("/api/v1/health").json()
    assert body["status"] == "ok"
    assert body["database"] == ("sqlite" if database_url.startswith("sqlite") else "postgresql")


def test_config_values_json_cannot_hold_natively_round_trip(api):
    config = {"seed": 2**70, "eps": "NaN", "nested": {"ratio": 0.5}}
    run = register_run(api, "r1", config=config)
    assert run["config"] == config
    assert api.get("/api/v1/runs").json()["items"][0]["config"]["seed"] == 2**70


def test_nan_tokens_in_user_json_are_stored_as_wire_strings(api):
    body = ('{"config": {"eps": NaN, "max": Infinity}, "environment": {"extra": -Infinity},'
            ' "layers": [{"index": 0, "name": "a", "type": "Linear", "attrs": {"x": NaN}}]}')
    response = api.put("/api/v1/runs/r1", content=body,
                       headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    run = api.get("/api/v1/runs/r1").json()
    assert run["config"] == {"eps": "NaN", "max": "Infinity"}
    assert run["environment"]["extra"] == "-Infinity"
    assert api.get("/api/v1/runs/r1/layers").json()["items"][0]["attrs"] == {"x": "NaN"}


def test_delivery_outages_are_one_line_each_on_the_api_and_the_page(api):
    """The agent's `delivery` events (sent once delivery recovered) as the lines the run
    page and `ampwatch show` print; a detail the server cannot read still gives a line."""
    register_run(api, "outaged", 2)
    outage = {"start": "2025-01-01T12:00:03.5+00:00", "end": "2025-01-01T12:00:41+00:00",
              "cause": "connection refused", "batches_spooled": 4}
    events = [{"step": None, "kind": "delivery", "detail": outage},
              {"step": None, "kind": "finished", "detail": {}}]
    assert post_batch(api, "outaged", 0, make_steps(0, 5, 2), events=events).status_code == 200
    assert post_batch(api, "outaged", 1, make_steps(5, 5, 2)).status_code == 200
    odd = {"step": None, "kind": "delivery", "detail": {"start": "soon", "batches_spooled": 1}}
    assert post_batch(api, "outaged", 0, make_steps(0, 5, 2), rank=1,
                      events=[odd]).status_code == 200
    lines = api.get("/api/v1/runs/outaged").json()["delivery_outages"]
    assert lines == [  # in the order of their start
        "Delivery was interrupted from 2025-01-01 12:00:03 to 12:00:41 UTC (38 s): "
        "connection refused; 4 batches waited in the agent's spool and arrived.",
        "Rank 1: delivery was interrupted for a while; 1 batch waited in the agent's spool "
        "and arrived.",
    ]
    assert api.get("/runs/outaged", params={"format": "json"}).json()["run"][
        "delivery_outages"] == lines
    page = api.get("/runs/outaged").text
    assert 'id="delivery-outages"' in page and "(38 s): connection refused;" in page
    assert api.get("/api/v1/runs").json()["items"][0]["delivery_outages"] == []
