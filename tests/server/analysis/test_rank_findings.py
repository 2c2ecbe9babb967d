"""Rank findings and combined norms on hand-made streams of several ranks, through the
real app: the ranks are compared once every rank has sent a step, and each finding
lives on the rank it names."""

from __future__ import annotations

import math

from tests.utils import make_steps, post_batch, register_run

N_LAYERS = 4


def _register(api, run_id: str, world: int, parallelism: str, layout: str) -> None:
    register_run(api, run_id, N_LAYERS, environment={
        "world_size": world, "parallelism": parallelism, "grad_layout": layout})


def _rank_findings(api, run_id: str) -> list[dict]:
    return api.get("/api/v1/findings", params={"run_id": run_id, "kind": "ranks"}).json()["items"]


def test_ranks_are_compared_only_once_every_rank_sent_the_steps(api):
    _register(api, "r", 2, "ddp", "replicated")
    post_batch(api, "r", 0, make_steps(0, 10, N_LAYERS, loss_scale=1024.0), rank=0)
    assert _rank_findings(api, "r") == []  # rank 1 has sent nothing yet
    post_batch(api, "r", 0, make_steps(0, 10, N_LAYERS, loss_scale=2048.0), rank=1)
    found = _rank_findings(api, "r")
    assert [(f["code"], f["rank"], f["step"]) for f in found] == [("scaler_disagreement", 1, 0)]
    assert found[0]["count"] == 10 and "rank 1" in found[0]["message"]


def test_the_rank_whose_forward_went_nonfinite_first_is_named(api):
    _register(api, "nf", 3, "ddp", "replicated")
    for rank in range(3):
        steps = make_steps(0, 8, N_LAYERS, skipped={5}, sample_every=1)
        if rank == 2:  # its forward overflowed in layer 1 on step 5
            steps[5]["activations"]["absmax"][1] = "Infinity"
            steps[5]["loss"] = "Infinity"
        post_batch(api, "nf", 0, steps, rank=rank)
    found = _rank_findings(api, "nf")
    assert [(f["code"], f["rank"], f["step"], f["layer"]) for f in found] == [
        ("first_nonfinite_rank", 2, 5, "blocks.1.fc")]
    assert found[0]["evidence"]["clean_ranks"] == [0, 1]
    # one incident on rank 2: its forward overflow in that layer, seen first on that rank
    incidents = api.get("/api/v1/runs/nf/incidents").json()["items"]
    rank2 = [i for i in incidents if i["rank"] == 2 and i["layer"] == "blocks.1.fc"]
    assert len(rank2) == 1 and found[0]["id"] in rank2[0]["findings"]


def test_a_straggler_is_the_rank_slow_in_its_own_work(api):
    _register(api, "st", 4, "ddp", "replicated")
    for rank in range(4):
        steps = make_steps(0, 20, N_LAYERS)
        for s in steps:  # every rank's step takes as long; rank 3 waits least in backward
            s["t_step_ms"], s["t_backward_ms"] = 60.0, 10.0 if rank == 3 else 40.0
            s["t_forward_ms"] = 5.0
        post_batch(api, "st", 0, steps, rank=rank)
    found = _rank_findings(api, "st")
    assert [(f["code"], f["rank"]) for f in found] == [("straggler", 3)]
    assert found[0]["evidence"]["own_ms_median"] > found[0]["evidence"]["others_ms_median"]


def test_sharded_norms_combine_only_when_every_rank_sent_the_step(api):
    _register(api, "sh", 2, "fsdp2", "sharded")
    a = make_steps(0, 4, N_LAYERS)
    b = make_steps(0, 3, N_LAYERS)
    for s in b:
        s["grad_norm"], s["layer_grad_norm"] = 2.0, [0.5, None, 1.0, 2.0]
    post_batch(api, "sh", 0, a, rank=0)
    post_batch(api, "sh", 0, b, rank=1)
    combined = api.get("/api/v1/runs/sh/grad_norms", params={"layers": "true"}).json()
    assert combined["steps"] == [0, 1, 2]  # step 3: rank 1 has not sent it
    for step, total, layers in zip(combined["steps"], combined["grad_norm"],
                                   combined["layer_grad_norm"], strict=True):
        mine = a[step]
        assert math.isclose(total, math.hypot(mine["grad_norm"], 2.0), rel_tol=1e-12)
        expected = [math.hypot(x, y) if y is not None else x
                    for x, y in zip(mine["layer_grad_norm"], [0.5, None, 1.0, 2.0], strict=True)]
        assert all(math.isclose(v, e, rel_tol=1e-6) for v, e in zip(layers, expected, strict=True))


def test_ranks_panel_and_page_show_each_rank(api):
    _register(api, "pg", 2, "ddp", "replicated")
    for rank in range(2):
        post_batch(api, "pg", 0, make_steps(0, 5, N_LAYERS, loss_scale=1024.0 * (rank + 1)),
                   rank=rank)
    ranks = api.get("/api/v1/runs/pg/ranks").json()
    assert [(r["rank"], r["loss_scale"], r["step_ms_median"]) for r in ranks["items"]] == [
        (0, 1024.0, 33.0), (1, 2048.0, 33.0)]
    twin = api.get("/runs/pg", params={"format": "json"}).json()
    assert [r["rank"] for r in twin["ranks"]] == [0, 1]
    page = api.get("/runs/pg").text
    assert 'id="ranks-panel"' in page and 'id="rank-1"' in page
    assert "rank 1" in page  # the disagreement finding names its rank
