"""Ingest: round trip, exact non-finite values, dedupe, gaps, gzip, bad input."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import zstandard
from sqlalchemy import func, select

from ampwatch.server.models import Batch
from ampwatch.server.store.codec import ITEMSIZE, decode_column
from tests.utils import make_steps, post_batch, register_run


def stored_batches(app) -> int:
    with app.state.sessionmaker() as session:
        return session.scalar(select(func.count()).select_from(Batch))


def test_round_trip_keeps_nan_and_infinities_exactly(api):
    register_run(api, "r1", n_layers=3)
    steps = make_steps(0, 3, 3)
    steps[1].update(grad_norm="NaN", loss="-Infinity", skipped=True,
                    layer_grad_norm=["NaN", "Infinity", None])
    steps[2].update(activations={"absmax": ["Infinity", 5.0, None],
                                 "dtype": ["float16", "float32", None], "time_ms": [1, 2, None]})
    assert post_batch(api, "r1", 0, steps).json()["stored_steps"] == 3

    items = api.get("/api/v1/runs/r1/steps").json()["items"]
    assert [s["step"] for s in items] == [0, 1, 2]
    assert items[1]["grad_norm"] == "NaN" and items[1]["loss"] == "-Infinity"
    assert items[1]["skipped"] is True and items[0]["skipped"] is False
    assert items[0]["lr"] == 3e-4 and items[0]["grad_norm_clipped"] is None

    series = api.get("/api/v1/runs/r1/layers/1/series").json()
    assert [p["grad_norm"] for p in series["grad"]][1] == "Infinity"
    assert series["activations"][0]["act_absmax"] == 5.0
    assert series["activations"][0]["act_dtype"] == "float32"
    layer0 = api.get("/api/v1/runs/r1/layers/0/series").json()
    assert layer0["grad"][1]["grad_norm"] == "NaN"
    assert layer0["activations"][0]["act_absmax"] == "Infinity"
    layer2 = api.get("/api/v1/runs/r1/layers/2/series").json()
    assert layer2["grad"][1]["grad_norm"] is None  # missing stays missing, not NaN


def test_gzip_body(api):
    register_run(api, "r1")
    body = json.dumps({"rank": 0, "seq": 0, "steps": make_steps(0, 5, 4)}).encode()
    response = api.post("/api/v1/runs/r1/batches", content=gzip.compress(body),
                        headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["stored_steps"] == 5


def test_repeated_seq_is_acknowledged_and_ignored(api, app):
    register_run(api, "r1")
    first = post_batch(api, "r1", 0, make_steps(0, 5, 4)).json()
    again = post_batch(api, "r1", 0, make_steps(0, 5, 4)).json()
    assert first["duplicate"] is False and again == {**first, "duplicate": True,
                                                     "stored_steps": 0}
    run = api.get("/api/v1/runs/r1").json()
    assert run["steps"] == 5 and run["lost_batches"] == 0
    assert stored_batches(app) == 1


def test_a_batch_stored_in_the_earlier_codec_layout_is_a_duplicate_when_resent(api, app):
    """A spool resending a batch an older server stored (byte shuffle and zstd, no delta)
    gets a duplicate ack, not a conflict: the stored columns are compared decoded."""
    register_run(api, "r1")
    steps = make_steps(0, 20, 4, sample_every=5)
    first = post_batch(api, "r1", 0, steps).json()
    shuffled = zstandard.ZstdCompressor(level=3)
    with app.state.engine.begin() as conn:
        stored = conn.execute(select(Batch)).one()
        earlier = {}
        for column, itemsize in ITEMSIZE.items():
            data = getattr(stored, column)
            if data is not None:  # as the earlier server wrote it
                raw = np.frombuffer(decode_column(data, itemsize), np.uint8)
                earlier[column] = shuffled.compress(raw.reshape(-1, itemsize).T.tobytes())
        conn.execute(Batch.__table__.update().values(**earlier))
    again = post_batch(api, "r1", 0, steps)
    assert again.status_code == 200, again.text
    assert again.json() == {**first, "duplicate": True, "stored_steps": 0}
    changed = post_batch(api, "r1", 0, make_steps(0, 20, 4, sample_every=4))
    assert changed.status_code == 409  # other content under that seq is still refused


def test_gap_in_seq_is_reported_as_lost_batches(api):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 5, 4))
    post_batch(api, "r1", 3, make_steps(15, 5, 4))
    run = api.get("/api/v1/runs/r1").json()
    assert run["lost_batches"] == 2 and run["ranks"][0]["next_seq"] == 4
    post_batch(api, "r1", 1, make_steps(5, 5, 4))  # late arrival fills part of the gap
    assert api.get("/api/v1/runs/r1").json()["lost_batches"] == 1


def test_ranks_are_kept_apart(api):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 5, 4), rank=0)
    post_batch(api, "r1", 0, make_steps(0, 5, 4, skipped={2}), rank=1)
    run = api.get("/api/v1/runs/r1").json()
    assert [(r["rank"], r["steps"], r["skipped"]) for r in run["ranks"]] == [(0, 5, 0), (1, 5, 1)]
    rank1 = api.get("/api/v1/runs/r1/steps?rank=1").json()["items"]
    assert [s["skipped"] for s in rank1] == [False, False, True, False, False]
    assert len(api.get("/api/v1/runs/r1/steps").json()["items"]) == 10


def test_dropped_counts_reach_the_run(api):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 2, 4), dropped_batches=3, dropped_steps=150)
    post_batch(api, "r1", 1, make_steps(2, 2, 4), dropped_batches=1, dropped_steps=50)
    run = api.get("/api/v1/runs/r1").json()
    assert (run["dropped_batches"], run["dropped_steps"]) == (3, 150)


BAD_BATCHES = {
    "wrong type": {"rank": 0, "seq": 0, "steps": [{"step": "one"}]},
    "negative seq": {"rank": 0, "seq": -1, "steps": []},
    "unknown field": {"rank": 0, "seq": 0, "steps": [{"step": 1, "loss_scael": 2.0}]},
    "not a number string": {"rank": 0, "seq": 0, "steps": [{"step": 1, "loss": "nan-ish"}]},
    "steps out of order": {"rank": 0, "seq": 0,
                           "steps": [{"step": 2}, {"step": 1}]},
    "unknown dtype": {"rank": 0, "seq": 0, "steps": [{"step": 1, "autocast_dtype": "fp17"}]},
}


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_bad_batches_get_422_and_write_nothing(api, app, name):
    register_run(api, "r1")
    response = api.post("/api/v1/runs/r1/batches", json=BAD_BATCHES[name])
    assert response.status_code == 422
    assert response.json()["detail"]
    assert stored_batches(app) == 0


def test_vector_length_must_match_the_layer_table(api, app):
    register_run(api, "r1", n_layers=4)
    steps = make_steps(0, 3, 4)
    steps[2]["layer_grad_norm"] = [1.0, 2.0]
    response = post_batch(api, "r1", 0, steps)
    assert response.status_code == 422
    assert "layer_grad_norm has 2 entries" in response.json()["detail"]
    assert "has 4" in response.json()["detail"]
    assert stored_batches(app) == 0
    assert api.get("/api/v1/runs/r1").json()["steps"] == 0


def test_unknown_run_is_404(api, app):
    response = post_batch(api, "nobody", 0, make_steps(0, 1, 4))
    assert response.status_code == 404 and "nobody" in response.json()["detail"]
    assert api.get("/api/v1/runs/nobody").status_code == 404
    assert api.get("/api/v1/runs/nobody/steps").status_code == 404


def test_malformed_json_and_bad_gzip(api, app):
    register_run(api, "r1")
    bad_json = api.post("/api/v1/runs/r1/batches", content=b'{"rank": 0, "seq": ',
                        headers={"content-type": "application/json"})
    assert bad_json.status_code == 422
    bad_gzip = api.post("/api/v1/runs/r1/batches", content=b"not gzip at all",
                        headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert bad_gzip.status_code == 400 and "gzip" in bad_gzip.json()["detail"]
    other = api.post("/api/v1/runs/r1/batches", content=b"{}",
                     headers={"content-encoding": "br", "content-type": "application/json"})
    assert other.status_code == 415
    assert stored_batches(app) == 0


@pytest.fixture
def small_limit_api(settings):
    from ampwatch.server.app import close_app, create_app
    from tests.conftest import judged_client

    app = create_app(settings.model_copy(update={"max_body_bytes": 4096}))
    with judged_client(app) as client:
        yield client
    close_app(app)


def test_body_over_the_limit_is_413(small_limit_api):
    api = small_limit_api
    register_run(api, "r1", n_layers=2)
    big = json.dumps({"rank": 0, "seq": 0, "steps": make_steps(0, 40, 2)}).encode()
    assert len(big) > 4096
    response = api.post("/api/v1/runs/r1/batches", content=big,
                        headers={"content-type": "application/json"})
    assert response.status_code == 413 and "4096" in response.json()["detail"]
    bomb = gzip.compress(b'{"rank": 0, "seq": 0, "steps": []' + b" " * 100_000 + b"}")
    assert len(bomb) < 4096
    response = api.post("/api/v1/runs/r1/batches", content=bomb,
                        headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert response.status_code == 413 and "decompression" in response.json()["detail"]
    assert api.get("/api/v1/runs/r1").json()["steps"] == 0


def test_non_finite_summary_values_do_not_break_the_run_view(api):
    register_run(api, "r1")
    steps = make_steps(0, 2, 4)
    steps[1].update(loss_scale="Infinity", scale_after="NaN")
    post_batch(api, "r1", 0, steps)
    run = api.get("/api/v1/runs/r1").json()
    assert run["loss_scale"] == 65536.0  # the last finite scale
    assert math.isclose(run["skip_rate"], 0.0)


def test_a_used_seq_with_other_steps_is_a_conflict_not_a_duplicate(api, app):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 5, 4))
    response = post_batch(api, "r1", 0, make_steps(100, 5, 4))  # a resumed agent from seq 0
    assert response.status_code == 409
    assert "already holds steps 0..4" in response.json()["detail"]
    assert api.get("/api/v1/runs/r1").json()["steps"] == 5
    assert post_batch(api, "r1", 1, make_steps(100, 5, 4)).json()["stored_steps"] == 5
