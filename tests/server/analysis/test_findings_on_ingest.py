"""Incremental analysis through the real app and database: one finding per persisting
condition, resolution on recovery, run health, registration-time checks, the API."""

from __future__ import annotations

from ampwatch.wire import encode_tree
from tests.server.analysis.factories import INF, NAN, activations, scaler_steps
from tests.utils import register_run

LAYERS = [
    {"index": i, "name": f"fc{i}", "type": "Linear", "param_count": 64 * 64 * 1000,
     "attrs": {"in_features": 64, "out_features": 64}, "forward_index": i}
    for i in range(4)
]
ENV = {"autocast_dtype": "float16", "scaler": {"growth_interval": 2000, "enabled": True}}


def register(api, run_id="r1", layers=LAYERS, environment=ENV):
    return register_run(api, run_id, layers=layers, environment=environment)


def post(api, run_id, steps, first_seq=0, rank=0, per_batch=50):
    for i in range(0, len(steps), per_batch):
        body = {"rank": rank, "seq": first_seq + i // per_batch,
                "steps": encode_tree(steps[i:i + per_batch])}
        response = api.post(f"/api/v1/runs/{run_id}/batches", json=body)
        assert response.status_code == 200, response.text


def findings(api, run_id="r1", **filters):
    response = api.get(f"/api/v1/runs/{run_id}/findings", params=filters)
    assert response.status_code == 200, response.text
    return response.json()["items"]


def forward_overflow(steps, layer=2):
    for s in steps:
        if s["skipped"]:
            values = [1.0, 2.0, 3.0, 4.0]
            values[layer:] = [INF] + [NAN] * (3 - layer)
            s.update(activations=activations(values), loss=NAN, layer_grad_norm=[NAN] * 4)
    return steps


def test_persisting_condition_updates_one_finding_and_recovery_resolves(api):
    register(api)
    # overflow in fc2's forward pass from step 200 on, sent in batches of 50
    steps = forward_overflow(scaler_steps(300, overflow=range(200, 300), init_scale=2.0**40))
    post(api, "r1", steps)
    streaks = findings(api, kind="scaler_divergence")
    streak = next(f for f in streaks if f["evidence"]["check"] == "skip_streak")
    assert len([f for f in streaks if f["evidence"]["check"] == "skip_streak"]) == 1
    assert streak["status"] == "open" and streak["severity"] == "critical"
    assert (streak["step"], streak["last_step"], streak["count"]) == (200, 299, 100)
    assert streak["evidence"]["cause"] == "forward_overflow" and streak["layer"] == "fc2"
    nonfinite = findings(api, kind="nonfinite")
    assert [(f["layer"], f["evidence"]["first_nonfinite_layer"]) for f in nonfinite] == \
        [("fc2", "fc2")]
    assert nonfinite[0]["count"] == 100
    assert api.get("/api/v1/runs/r1").json()["status"] == "critical"

    # the layer is fixed: clean steps again
    post(api, "r1", scaler_steps(200, first=300, init_scale=1024.0), first_seq=6)
    streak = next(f for f in findings(api, kind="scaler_divergence")
                  if f["evidence"]["check"] == "skip_streak")
    assert streak["status"] == "resolved" and streak["count"] == 100
    assert findings(api, kind="nonfinite")[0]["status"] == "resolved"
    run = api.get("/api/v1/runs/r1").json()
    assert run["status"] == "healthy" and run["open_findings"] == len(findings(api,
                                                                               status="open"))


def test_condition_back_soon_reopens_its_finding(api):
    register(api)
    steps = scaler_steps(400, overflow=[*range(100, 110), *range(300, 310)],
                         init_scale=2.0**40)
    post(api, "r1", steps[:200])
    first = findings(api, kind="scaler_divergence")
    assert [f["status"] for f in first] == ["resolved"]
    post(api, "r1", steps[200:], first_seq=4)
    again = findings(api, kind="scaler_divergence")
    assert [(f["id"], f["count"], f["last_step"]) for f in again] == \
        [(first[0]["id"], 20, 309)]


def test_healthy_run_ends_healthy(api):
    register(api)
    post(api, "r1", scaler_steps(600, fits=4096.0))
    assert [f for f in findings(api) if f["severity"] != "info"] == []
    assert api.get("/api/v1/runs/r1").json()["status"] == "healthy"


def test_older_batch_adds_history_without_changing_state(api):
    register(api)
    steps = scaler_steps(300, overflow=range(100, 130), init_scale=2.0**40)
    post(api, "r1", steps[200:], first_seq=4)
    post(api, "r1", steps[:200])  # replayed late, e.g. from the agent's spool
    streak = findings(api, kind="scaler_divergence")
    assert [(f["status"], f["step"], f["count"]) for f in streak] == [("resolved", 100, 30)]
    assert api.get("/api/v1/runs/r1").json()["status"] == "healthy"


def test_ranks_are_analysed_apart(api):
    register(api)
    post(api, "r1", scaler_steps(200, init_scale=2.0**40))
    post(api, "r1", scaler_steps(200, overflow=range(150, 200), init_scale=2.0**40), rank=1)
    assert {f["rank"] for f in findings(api, kind="scaler_divergence")} == {1}
    assert findings(api, kind="scaler_divergence", rank=0) == []


def test_setup_is_judged_at_registration_and_follows_the_layer_table(api):
    layers = [{"index": 0, "name": "wte", "type": "Embedding", "param_count": 50257 * 64,
               "attrs": {"num_embeddings": 50257, "embedding_dim": 64}, "forward_index": 0},
              {"index": 1, "name": "odd", "type": "Linear", "param_count": 64 * 127,
               "attrs": {"in_features": 64, "out_features": 127}, "forward_index": 1},
              {"index": 2, "name": "head", "type": "Linear", "param_count": 0,
               "attrs": {"in_features": 64, "out_features": 50257, "tied_to": "wte"},
               "forward_index": 2}]
    register(api, layers=layers)
    flagged = {(f["layer"], f["evidence"]["dimension"], f["evidence"]["padded"])
               for f in findings(api, kind="misaligned_layer")}
    assert flagged == {("head", "out_features", 50264), ("odd", "out_features", 128)}

    layers[1]["attrs"]["out_features"] = 128
    register(api, layers=layers)
    assert {f["layer"] for f in findings(api, kind="misaligned_layer", status="open")} == \
        {"head"}
    assert {f["layer"] for f in findings(api, kind="misaligned_layer", status="resolved")} == \
        {"odd"}


def test_findings_api_filters_and_pages(api):
    register(api, "a")
    register(api, "b")
    post(api, "a", forward_overflow(scaler_steps(100, overflow=range(80, 100),
                                                 init_scale=2.0**40)))
    post(api, "b", scaler_steps(100, overflow=range(60, 70), init_scale=2.0**40))
    assert api.get("/api/v1/runs/nope/findings").status_code == 404
    assert api.get("/api/v1/runs/a/findings", params={"severity": "bad"}).status_code == 422

    everything = api.get("/api/v1/findings", params={"limit": 1000}).json()
    assert everything["total"] == len(everything["items"]) >= 4
    assert {f["run_id"] for f in everything["items"]} == {"a", "b"}
    page = api.get("/api/v1/findings", params={"limit": 2, "offset": 1}).json()
    assert page["items"] == everything["items"][1:3] and page["total"] == everything["total"]

    critical = api.get("/api/v1/findings", params={"severity": "critical"}).json()["items"]
    assert critical and all(f["severity"] == "critical" for f in critical)
    b_only = api.get("/api/v1/findings", params={"run_id": "b", "kind": "scaler_divergence"})
    assert {f["run_id"] for f in b_only.json()["items"]} == {"b"}
    ordered = [f["severity"] for f in findings(api, "a", status="open")]
    rank = {"critical": 0, "warning": 1, "info": 2}
    assert ordered == sorted(ordered, key=rank.__getitem__)
    sample = everything["items"][0]
    assert set(sample) == {"id", "run_id", "kind", "code", "severity", "status", "rank", "step",
                           "last_step", "layer", "message", "evidence", "count", "created_at",
                           "updated_at", "incident"}


def test_a_runs_findings_list_open_ones_first(api):
    misaligned = [*LAYERS[:3], {**LAYERS[3], "attrs": {"in_features": 64, "out_features": 127}}]
    register(api, layers=misaligned)  # an open finding that stays open
    steps = forward_overflow(scaler_steps(300, overflow=range(200, 300), init_scale=2.0**40))
    post(api, "r1", steps)
    post(api, "r1", scaler_steps(200, first=300, init_scale=1024.0), first_seq=6)
    statuses = [f["status"] for f in findings(api)]
    assert "resolved" in statuses and "open" in statuses
    assert statuses == sorted(statuses, key=lambda status: status != "open")
