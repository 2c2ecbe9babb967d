"""Step ranges, pagination, downsampling that keeps problems, heatmap matrices."""

from __future__ import annotations

import pytest

from ampwatch.server.api import series
from tests.utils import make_steps, post_batch, register_run


def load(api, run_id="r1", total=3000, per_batch=500, skipped=frozenset(), n_layers=4):
    register_run(api, run_id, n_layers=n_layers)
    for seq, first in enumerate(range(0, total, per_batch)):
        steps = make_steps(first, min(per_batch, total - first), n_layers, skipped=skipped,
                           sample_every=10)
        assert post_batch(api, run_id, seq, steps).status_code == 200


def test_range_and_limit_pagination(api):
    load(api, total=1200)
    page = api.get("/api/v1/runs/r1/steps?start=100&end=199").json()
    assert [s["step"] for s in page["items"]] == list(range(100, 200))
    page = api.get("/api/v1/runs/r1/steps?limit=500").json()
    assert page["count"] == 500 and page["next_start"] == 500 and page["total"] == 1200
    rest = api.get("/api/v1/runs/r1/steps?start=500&limit=1000").json()
    assert rest["next_start"] is None and rest["items"][-1]["step"] == 1199


def test_downsampling_returns_at_most_max_points_and_every_event_apart(api):
    skipped = {7, 1234, 1235, 2999}
    load(api, total=3000, skipped=skipped)
    steps = make_steps(3000, 1, 4)
    steps[0]["grad_norm"] = 1e6  # a single spike
    steps[0]["loss"] = "NaN"
    post_batch(api, "r1", 99, steps)
    for max_points in (10, 100):
        page = api.get(f"/api/v1/runs/r1/steps?max_points={max_points}").json()
        assert page["downsampled"] and page["total"] == 3001
        assert page["count"] == len(page["items"]) <= max_points
        events = {s["step"]: s for s in page["events"]}
        assert set(events) == skipped | {3000}  # every skipped or non-finite step
        assert all(events[s]["skipped"] for s in skipped)
        assert events[3000]["grad_norm"] == 1e6 and events[3000]["loss"] == "NaN"
    kept = {s["step"]: s for s in page["items"]}
    assert 0 in kept  # the first bucket's start; the spike at 3000 is an event (NaN loss)
    everything = api.get("/api/v1/runs/r1/steps?limit=5000").json()
    assert everything["events"] == [] and everything["count"] == 3001


def test_matrix_buckets_keep_nonfinite_cells(api):
    load(api, total=1000, skipped={555})
    matrix = api.get("/api/v1/runs/r1/layers/matrix?buckets=10").json()
    assert len(matrix["layers"]) == 4 and len(matrix["step_start"]) == 10
    assert matrix["step_start"][0] == 0 and matrix["step_end"][-1] == 999
    row0 = matrix["values"][0]
    assert row0[5] == "Infinity"  # layer 0 had inf grads at step 555
    assert all(v == pytest.approx(0.01) for i, v in enumerate(row0) if i != 5)
    assert all(isinstance(v, float) for v in matrix["values"][1])
    acts = api.get("/api/v1/runs/r1/layers/matrix?metric=act_absmax&buckets=5").json()
    assert acts["values"][3] == [4.0] * 5
    assert api.get("/api/v1/runs/r1/layers/matrix?metric=bogus").status_code == 422


def test_matrix_reads_a_range_of_layers_and_caps_its_cells(api, monkeypatch):
    load(api, total=100, skipped={55})
    whole = api.get("/api/v1/runs/r1/layers/matrix?buckets=10").json()
    part = api.get("/api/v1/runs/r1/layers/matrix",
                   params={"buckets": 10, "layer_offset": 1, "layer_limit": 2}).json()
    assert part["layers"] == whole["layers"][1:3]
    assert part["values"] == whole["values"][1:3]
    assert part["step_start"] == whole["step_start"]
    past = api.get("/api/v1/runs/r1/layers/matrix", params={"layer_offset": 9}).json()
    assert past["layers"] == [] and past["values"] == []
    monkeypatch.setattr(series, "MAX_MATRIX_CELLS", 30)
    refused = api.get("/api/v1/runs/r1/layers/matrix?buckets=10")
    assert refused.status_code == 422 and "layer_limit" in refused.json()["detail"]
    assert api.get("/api/v1/runs/r1/layers/matrix",
                   params={"buckets": 10, "layer_limit": 3}).status_code == 200


def test_layer_series_downsampling_keeps_nonfinite(api):
    load(api, total=3000, skipped={1500})
    series = api.get("/api/v1/runs/r1/layers/0/series?max_points=50").json()
    assert series["downsampled"] and len(series["grad"]) <= 50
    assert [(p["step"], p["grad_norm"]) for p in series["events"]] == [(1500, "Infinity")]
    assert api.get("/api/v1/runs/r1/layers/9/series").status_code == 404


def test_layer_summaries(api):
    load(api, total=100, skipped={50})
    items = api.get("/api/v1/runs/r1/layers").json()["items"]
    assert items[0]["summary"]["grad_nonfinite_steps"] == 1
    assert items[1]["summary"]["grad_norm_max"] == pytest.approx(0.02)
    assert items[3]["summary"]["act_absmax_max"] == 4.0
    assert items[3]["summary"]["act_dtype"] == "float16"


def test_pages_over_several_ranks_never_repeat_a_row(api):
    register_run(api, "r1")
    post_batch(api, "r1", 0, make_steps(0, 30, 4), rank=0)
    post_batch(api, "r1", 0, make_steps(10, 30, 4), rank=1)
    seen, start = [], 0
    while start is not None:
        page = api.get(f"/api/v1/runs/r1/steps?start={start}&limit=7").json()
        seen += [(row["rank"], row["step"]) for row in page["items"]]
        start = page["next_start"]
    assert sorted(seen) == sorted({*seen}) and len(seen) == 60
