"""Multi-rank runs end to end on the CPU: gloo process groups of 2 and 4 ranks
(torch.multiprocessing), the agent on every rank, one real server.

Ground truth comes from the ranks themselves (tests/agent/ranks_worker.py): full
gradients gathered there, the scale read from each rank's GradScaler, whether its
optimizer stepped. One spawn per world size runs every scenario in turn, so the test pays
the process start-up twice; the ranks are forked, so they do not import torch again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch.multiprocessing as mp

from tests.agent import ranks_worker
from tests.conftest import LiveServer, free_port
from tests.utils import WAIT

REL = 1e-6
SCENARIOS = {2: ["ddp", "fsdp2", "ddp_scalers"], 4: ["ddp", "fsdp2", "fsdp1", "tp"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("ranks-server")
    live = LiveServer(f"sqlite:///{tmp / 'live.db'}", tmp / "server.log")
    live.start()
    yield live
    live.stop()


# (world size, path): the accelerator's path forced on the CPU once, on 2 ranks, where
# no replay may run (a collective) and the held outputs' flagged kernel names the layer
JOBS = [(2, "host"), (4, "host"), (2, "device")]


@pytest.fixture(scope="module", params=JOBS, ids=[f"{w}-{p}" for w, p in JOBS])
def job(request: pytest.FixtureRequest, server: LiveServer,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Train every scenario on `world` ranks; returns what each rank reported."""
    world, path = request.param
    out = tmp_path_factory.mktemp(f"ranks-{world}-{path}")
    with pytest.MonkeyPatch.context() as patch:  # the forked ranks inherit the setting
        patch.setenv("AMPWATCH_DEVICE_PATH", "1" if path == "device" else "0")
        # fork: the ranks inherit the imported torch instead of importing it again each
        mp.start_processes(ranks_worker.main, nprocs=world, start_method="fork", args=(
            world, free_port(), server.url, str(out), SCENARIOS[world], f"w{world}{path}"))
    ranks = [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]
    with httpx.Client(base_url=server.url + "/api/v1", timeout=60) as api:
        yield {"world": world, "ranks": ranks, "api": api}


def _scenario(job: dict, name: str) -> tuple[str, list[dict]]:
    if name not in SCENARIOS[job["world"]]:
        pytest.skip(f"{name} runs on {[w for w, s in SCENARIOS.items() if name in s]} ranks")
    reports = [rank[name] for rank in job["ranks"]]
    assert len({r["run_id"] for r in reports}) == 1, "every rank writes into one run"
    return reports[0]["run_id"], reports


def _close(value, expected: float) -> bool:
    return isinstance(value, float) and abs(value - expected) <= REL * abs(expected)


def _layer_names(api: httpx.Client, run_id: str) -> list[str]:
    return [layer["name"] for layer in api.get(f"/runs/{run_id}/layers").json()["items"]]


def test_every_rank_delivers_and_reports_no_error(job):
    for rank in job["ranks"]:
        for name, report in rank.items():
            assert report["errors"] == {}, (name, report["errors"])
            assert report["delivered"] is True, name


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_one_stream_per_rank_with_exact_scale_and_skips(job, name):
    run_id, reports = _scenario(job, name)
    api = job["api"]
    run = api.get(f"/runs/{run_id}").json()
    assert [r["rank"] for r in run["ranks"]] == list(range(job["world"]))
    assert run["environment"]["parallelism"] == name
    steps = api.get(f"/runs/{run_id}/steps").json()["items"]
    for rank, report in enumerate(reports):
        mine = [s for s in steps if s["rank"] == rank]
        assert [s["step"] for s in mine] == [t["step"] for t in report["steps"]]
        assert [s["loss_scale"] for s in mine] == [t["loss_scale"] for t in report["steps"]]
        assert [s["skipped"] for s in mine] == [t["skipped"] for t in report["steps"]]
    assert any(t["skipped"] for t in reports[0]["steps"]), "the overflow step was skipped"


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_combined_grad_norms_equal_the_full_gradients(job, name):
    run_id, reports = _scenario(job, name)
    api = job["api"]
    names = _layer_names(api, run_id)
    combined = api.get(f"/runs/{run_id}/grad_norms", params={"layers": "true"}).json()
    assert combined["grad_layout"] == ("replicated" if name == "ddp" else "sharded")
    truth = reports[0]["steps"]  # full grads are the same on every rank after the reduction
    assert combined["steps"] == [t["step"] for t in truth]
    assert sum(t["total"] > ranks_worker.CLIP for t in truth) >= len(truth) // 2  # it clipped
    for t, total, layers in zip(truth, combined["grad_norm"], combined["layer_grad_norm"],
                                strict=True):
        expected = math.sqrt(sum(v * v for v in t["layers"].values()))
        if not math.isfinite(expected):
            assert total == "NaN" or total == "Infinity", t["step"]
            continue
        assert _close(total, expected), (t["step"], total, expected)  # before the clip
        for index, layer in enumerate(names):
            if layer in t["layers"]:
                assert _close(layers[index], t["layers"][layer]), (t["step"], layer)
            else:
                assert layers[index] is None  # ReLU: no parameters, no grad


def test_ddp_stores_per_layer_norms_once_per_step(job):
    run_id, _ = _scenario(job, "ddp")
    api = job["api"]
    for rank in range(job["world"]):
        matrix = api.get(f"/runs/{run_id}/layers/matrix", params={"rank": rank}).json()
        cells = [v for row in matrix["values"] for v in row if v is not None]
        assert bool(cells) == (rank == 0), rank


def test_rank_findings_name_the_faulty_rank(job):
    api = job["api"]
    last = job["world"] - 1
    run_id, _ = _scenario(job, "ddp")
    found = api.get("/findings", params={"run_id": run_id, "kind": "ranks", **WAIT}
                    ).json()["items"]
    by_code = {f["code"]: f for f in found}
    first = by_code["first_nonfinite_rank"]
    assert (first["rank"], first["step"]) == (last, ranks_worker.OVERFLOW_STEP)
    assert first["layer"] == "module.0"
    assert by_code["straggler"]["rank"] == last
    assert "scaler_disagreement" not in by_code  # every rank's scaler agrees here
    assert {f["rank"] for f in found} == {last}


def test_scaler_disagreement_names_the_rank_and_step(job):
    run_id, _ = _scenario(job, "ddp_scalers")
    found = job["api"].get("/findings", params={"run_id": run_id, **WAIT,
                                                "code": "scaler_disagreement"}).json()["items"]
    assert [(f["rank"], f["step"]) for f in found] == [(1, 0)]
    assert found[0]["evidence"]["loss_scale"] == 2048.0


def test_fsdp1_records_steps_and_the_whole_norm(job):
    run_id, reports = _scenario(job, "fsdp1")
    api = job["api"]
    run = api.get(f"/runs/{run_id}").json()
    assert run["environment"]["parallelism"] == "fsdp1"
    assert [r["steps"] for r in run["ranks"]] == [len(reports[0]["steps"])] * job["world"]
    combined = api.get(f"/runs/{run_id}/grad_norms").json()
    for t, total in zip(reports[0]["steps"], combined["grad_norm"], strict=True):
        if math.isfinite(t["total"]):  # what FSDP1's own clip_grad_norm_ returned
            assert _close(total, t["total"]), t["step"]


def test_tensor_parallel_records_steps_and_the_whole_norm(job):
    run_id, reports = _scenario(job, "tp")
    api = job["api"]
    run = api.get(f"/runs/{run_id}").json()
    assert run["environment"]["parallelism"] == "dtensor"
    assert [r["steps"] for r in run["ranks"]] == [len(reports[0]["steps"])] * job["world"]
    combined = api.get(f"/runs/{run_id}/grad_norms").json()
    for t, total in zip(reports[0]["steps"], combined["grad_norm"], strict=True):
        expected = math.sqrt(sum(v * v for v in t["layers"].values()))
        assert _close(total, expected), (t["step"], total, expected)
