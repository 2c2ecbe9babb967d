"""Hostile input against the real app on SQLite and Postgres: every rejected request is a
4xx with a short message and changes nothing; accepted numbers read back as sent."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from ampwatch.server.models import Batch, Finding, Layer, Run, RunRank
from tests.conftest import fresh_database_url
from tests.utils import make_steps, post_batch, register_run

HUGE = [2**63, 10**400]


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres",
                                                              marks=pytest.mark.postgres)])
def shared_app(request, tmp_path_factory):
    """One app per backend for the module (starting one runs the migrations); each test
    registers its own runs and compares the database before and after."""
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    url = fresh_database_url(request, request.param, tmp_path_factory.mktemp("hostile"))
    app = create_app(Settings(database_url=url))
    yield app
    close_app(app)


@pytest.fixture
def app(shared_app):
    with shared_app.state.engine.begin() as connection:
        for model in (Batch, Finding, RunRank, Layer, Run):
            connection.execute(model.__table__.delete())
    return shared_app


@pytest.fixture
def api(app):
    from tests.conftest import judged_client

    with judged_client(app) as client:
        yield client


def database_state(app) -> tuple:
    """Everything a request could have changed: row counts and every run's public view."""
    with app.state.sessionmaker() as session:
        counts = tuple(session.scalar(select(func.count()).select_from(model))
                       for model in (Run, Layer, RunRank, Batch, Finding))
        runs = session.execute(select(Run.id, Run.name, Run.n_layers, Run.config,
                                      Run.updated_at).order_by(Run.id)).all()
        ranks = session.execute(select(RunRank.run_id, RunRank.rank, RunRank.steps,
                                       RunRank.max_seq, RunRank.batches, RunRank.skipped,
                                       RunRank.dropped_steps)).all()
    return counts, [tuple(r) for r in runs], [tuple(r) for r in ranks]


@pytest.fixture
def run_with_data(api):
    register_run(api, "r1", n_layers=4)
    assert post_batch(api, "r1", 0, make_steps(0, 10, 4, skipped={3})).status_code == 200
    return "r1"


def assert_rejected(api, app, method: str, url: str, status: int = 422, **kwargs):
    before = database_state(app)
    response = api.request(method, url, **kwargs)
    assert response.status_code == status, response.text[:500]
    assert len(response.content) < 4096, "the error echoed its input"
    assert database_state(app) == before
    return response


@pytest.mark.parametrize("value", HUGE, ids=["2**63", "10**400"])
@pytest.mark.parametrize("field", ["scheduler_steps", "eval_forwards", "scaler_updates"])
def test_step_counters_beyond_the_columns_are_422(api, app, run_with_data, field, value):
    steps = make_steps(10, 2, 4)
    steps[1][field] = value
    body = json.dumps({"rank": 0, "seq": 1, "steps": steps})
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches", content=body,
                    headers={"content-type": "application/json"})


@pytest.mark.parametrize("value", HUGE, ids=["2**63", "10**400"])
@pytest.mark.parametrize("field", ["dropped_steps", "dropped_batches", "seq"])
def test_batch_counters_beyond_the_columns_are_422(api, app, run_with_data, field, value):
    body = {"rank": 0, "seq": 1, "steps": make_steps(10, 2, 4), field: value}
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches", content=json.dumps(body),
                    headers={"content-type": "application/json"})


def test_seq_at_the_integer_limit_is_refused_not_stored(api, app, run_with_data):
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 2**31, "steps": make_steps(10, 2, 4)})


def test_a_far_seq_gap_is_409_and_lost_batches_stay_sane(api, app, run_with_data):
    response = assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches", status=409,
                               json={"rank": 0, "seq": 2**31 - 1,
                                     "steps": make_steps(10, 2, 4)})
    assert "next seq 1" in response.json()["detail"]
    assert api.get("/api/v1/runs/r1").json()["lost_batches"] == 0
    # a modest gap is accepted and counted
    assert post_batch(api, "r1", 5, make_steps(10, 2, 4)).status_code == 200
    assert api.get("/api/v1/runs/r1").json()["lost_batches"] == 4


@pytest.mark.parametrize("value", HUGE, ids=["2**63", "10**400"])
@pytest.mark.parametrize("field", ["param_count", "forward_index"])
def test_layer_fields_beyond_the_columns_are_422(api, app, run_with_data, field, value):
    layer = {"index": 0, "name": "fc", "type": "Linear", field: value}
    assert_rejected(api, app, "PUT", "/api/v1/runs/r1",
                    content=json.dumps({"layers": [layer]}),
                    headers={"content-type": "application/json"})


@pytest.mark.parametrize("raw_name", ['"a\\ud800b"', '"a\\u0000b"'], ids=["surrogate", "nul"])
@pytest.mark.parametrize("where", ["name", "project", "tag", "layer"])
def test_unstorable_strings_are_422(api, app, run_with_data, raw_name, where):
    bodies = {
        "name": f'{{"name": {raw_name}}}',
        "project": f'{{"project": {raw_name}}}',
        "tag": f'{{"tags": [{raw_name}]}}',
        "layer": f'{{"layers": [{{"index": 0, "name": {raw_name}, "type": "Linear"}}]}}',
    }
    for run_id in ("r1", "new-run"):
        assert_rejected(api, app, "PUT", f"/api/v1/runs/{run_id}", content=bodies[where],
                        headers={"content-type": "application/json"})


@pytest.mark.parametrize("body", [
    {"layers": [{"index": 0, "name": "fc", "type": "Linear", "param_count": 2**53}]},
    {"layers": [{"index": 0, "name": "fc", "type": "Linear", "shapes": {"w": [2**53]}}]},
    {"config": {"a\x00b": 1}},
    {"environment": {"scaler": {"enabled": 0}}},
    {"environment": {"world_size": "2"}},
], ids=["param_count", "shape", "nul-key", "0-for-false", "str-for-int"])
def test_what_the_schema_refuses_is_422(api, app, run_with_data, body):
    """Integers beyond 2**53 - 1 (JSON readers keep no more exactly), NUL in a key,
    lax types in the environment: refused as the OpenAPI schema says."""
    assert_rejected(api, app, "PUT", "/api/v1/runs/r1", json=body)


def test_an_integer_written_with_a_zero_fraction_is_that_integer(api, app, run_with_data):
    steps = make_steps(10, 2, 4)
    steps[0]["step"], steps[1]["step"] = 10.0, 11.0
    reply = api.post("/api/v1/runs/r1/batches", json={"rank": 0.0, "seq": 1.0, "steps": steps})
    assert reply.status_code == 200 and reply.json()["stored_steps"] == 2
    assert [s["step"] for s in api.get("/api/v1/runs/r1/steps").json()["items"]][-2:] == [10, 11]
    steps[0]["step"] = 10.5
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 2, "steps": steps})


def test_nul_in_a_query_filter_is_422(api, app, run_with_data):
    assert_rejected(api, app, "GET", "/api/v1/runs", params={"name": "a\x00"})
    assert_rejected(api, app, "GET", "/api/v1/runs", params={"project": "a\x00"})


@pytest.mark.parametrize("value", ["1_000", " 1.5 ", "1.5", False, True, "nan", "inf"])
def test_floats_are_numbers_or_the_three_names_only(api, app, run_with_data, value):
    steps = make_steps(10, 1, 4)
    steps[0]["loss"] = value
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 1, "steps": steps})
    steps[0]["loss"] = 1.0
    steps[0]["layer_grad_norm"][2] = value
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 1, "steps": steps})


def test_a_megabyte_input_is_not_echoed(api, app, run_with_data):
    response = assert_rejected(api, app, "PUT", "/api/v1/runs/r1",
                               json={"name": "x" * 1_000_000})
    assert response.json()["detail"][0]["loc"] == ["body", "name"]
    steps = make_steps(10, 1, 4)
    steps[0]["loss"] = "y" * 1_000_000
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                    json={"rank": 0, "seq": 1, "steps": steps})


def test_config_over_the_limit_is_422(api, app, run_with_data):
    response = assert_rejected(api, app, "PUT", "/api/v1/runs/r1",
                               json={"config": {"blob": "z" * 70_000}})
    assert "65536" in json.dumps(response.json())
    assert api.put("/api/v1/runs/r1", json={"config": {"lr": 1e-3}}).status_code == 200


@pytest.mark.parametrize("value", [-3e39, -1.0, "-Infinity"])
@pytest.mark.parametrize("vector", ["layer_grad_norm", "absmax", "time_ms"])
def test_negative_per_layer_values_are_422(api, app, run_with_data, value, vector):
    steps = make_steps(10, 2, 4, sample_every=1)
    target = steps[1] if vector == "layer_grad_norm" else steps[1]["activations"]
    target[vector][2] = value
    response = assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches",
                               json={"rank": 0, "seq": 1, "steps": steps})
    assert "negative" in response.text and "step 11" in response.text and "[2]" in response.text


@pytest.mark.parametrize(("value", "stored"), [(1e39, 3.4028234663852886e38),
                                               (1e300, 3.4028234663852886e38),
                                               (1e-46, 1.401298464324817e-45)])
@pytest.mark.parametrize("vector", ["layer_grad_norm", "absmax", "time_ms"])
def test_per_layer_values_float32_cannot_keep_are_stored_clamped_and_flagged(
        api, app, run_with_data, value, stored, vector):
    """A value the server cannot store never costs the batch: it is stored as the nearest
    float32 (finite stays finite, non-zero stays non-zero) and the step gets an event
    with the value as sent."""
    from ampwatch.server.store.per_layer import FLOAT32_CLAMPED
    from ampwatch.server.store.storage import load_series

    steps = make_steps(10, 2, 4, sample_every=1)
    target = steps[1] if vector == "layer_grad_norm" else steps[1]["activations"]
    target[vector][2] = value
    assert post_batch(api, "r1", 1, steps).status_code == 200
    field = vector if vector == "layer_grad_norm" else f"activations.{vector}"
    with app.state.sessionmaker() as session:
        series = load_series(session, "r1", 0, n_layers=4)
    notes = [e for e in series.events if e["kind"] == FLOAT32_CLAMPED]
    assert notes == [{"step": 11, "kind": FLOAT32_CLAMPED,
                      "detail": {"field": field, "layers": [2], "sent": [value]}}]
    if vector == "layer_grad_norm":
        read = api.get("/api/v1/runs/r1/layers/2/series?start=11").json()["grad"][0]
        assert read["grad_norm"] == stored


def test_per_layer_values_read_back_as_sent(api, run_with_data):
    steps = make_steps(10, 1, 4)
    # float32's largest finite, a subnormal, zero and NaN survive as float32 keeps them
    steps[0]["layer_grad_norm"] = [3.4028234663852886e38, 1.401298464324817e-45, 0.0, "NaN"]
    assert post_batch(api, "r1", 1, steps).status_code == 200
    values = [api.get(f"/api/v1/runs/r1/layers/{i}/series?start=10").json()["grad"][0]
              ["grad_norm"] for i in range(4)]
    assert values == [3.4028234663852886e38, 1.401298464324817e-45, 0.0, "NaN"]


def test_overlapping_batches_count_each_step_once(api, app):
    register_run(api, "r1", n_layers=4)
    for seq, (first, count) in enumerate([(0, 10), (5, 10), (0, 5)]):
        skipped = {3, 12}
        assert post_batch(api, "r1", seq, make_steps(first, count, 4, skipped=skipped)
                          ).status_code == 200
    run = api.get("/api/v1/runs/r1").json()
    items = api.get("/api/v1/runs/r1/steps").json()["items"]
    assert [s["step"] for s in items] == list(range(15))
    assert run["steps"] == 15 and run["ranks"][0]["steps"] == 15
    assert run["skipped"] == sum(s["skipped"] for s in items) == 2
    assert run["lost_batches"] == 0


def test_a_resumed_run_replaces_skips_it_sent_again(api):
    """Steps resent with other outcomes: the totals follow the copy that reads return."""
    register_run(api, "r1", n_layers=4)
    post_batch(api, "r1", 0, make_steps(0, 10, 4, skipped={2, 4}))
    post_batch(api, "r1", 1, make_steps(0, 10, 4, skipped={4, 6, 8}))
    items = api.get("/api/v1/runs/r1/steps").json()["items"]
    run = api.get("/api/v1/runs/r1").json()
    assert [s["step"] for s in items if s["skipped"]] == [4, 6, 8]
    assert (run["steps"], run["skipped"]) == (10, 3)


def test_a_different_batch_under_a_used_seq_is_409_not_a_replay(api, app, run_with_data):
    same_steps = make_steps(0, 10, 4, skipped={3})
    assert post_batch(api, "r1", 0, same_steps).json()["duplicate"] is True
    other = make_steps(0, 10, 4, skipped={3})
    other[7]["loss"] = 99.0
    response = assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches", status=409,
                               json={"rank": 0, "seq": 0, "steps": other})
    assert "not a replay" in response.json()["detail"]
    other = make_steps(0, 10, 4, skipped={3})
    other[2]["layer_grad_norm"][1] = 7.0
    assert_rejected(api, app, "POST", "/api/v1/runs/r1/batches", status=409,
                    json={"rank": 0, "seq": 0, "steps": other})
    items = api.get("/api/v1/runs/r1/steps").json()["items"]
    assert items[7]["loss"] == make_steps(0, 10, 4)[7]["loss"]


def _reached(app, run_id: str) -> int | None:
    with app.state.sessionmaker() as session:
        return session.get(RunRank, (run_id, 0)).reached_step


def _received(app, run_id: str, seq: int, seconds_ago: float) -> None:
    with app.state.sessionmaker() as session:
        session.get(Batch, (run_id, 0, seq)).received_at = (
            datetime.now(UTC) - timedelta(seconds=seconds_ago))
        session.commit()


def test_a_heartbeat_beyond_any_plausible_step_is_422(api, app, run_with_data):
    """A forged heartbeat would record 9e15 lost steps for good (reached_step only rises)."""
    url = "/api/v1/runs/r1/ranks/0/reached"
    assert_rejected(api, app, "POST", url, json={"reached_step": 9 * 10**15})
    assert _reached(app, "r1") is None
    assert api.post(url, json={"reached_step": 5_000}).status_code == 204  # a young run
    assert _reached(app, "r1") == 5_000


def test_a_heartbeat_is_bounded_by_the_ranks_observed_step_rate(api, app, run_with_data):
    # 100,000 steps between two batches 90 s apart (1,111 steps/s), the last 10 s ago
    assert post_batch(api, "r1", 1, make_steps(100_000, 10, 4)).status_code == 200
    _received(app, "r1", 0, 100)
    _received(app, "r1", 1, 10)
    url = "/api/v1/runs/r1/ranks/0/reached"
    assert_rejected(api, app, "POST", url, json={"reached_step": 1_000_000})
    assert api.post(url, json={"reached_step": 200_000}).status_code == 204
    assert _reached(app, "r1") == 200_000
