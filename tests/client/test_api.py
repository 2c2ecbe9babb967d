"""`client.Client` against the real app on a real database."""

from __future__ import annotations

import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from ampwatch.client import (
    AnalysisPending,
    BadRequest,
    Client,
    ConnectionFailed,
    Finding,
    Layer,
    NotFound,
    Run,
    Step,
    Unauthorized,
)
from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from ampwatch.server.worker.analysis_worker import AnalysisWorker
from tests.client.conftest import N_LAYERS, seed_diverging, seed_healthy
from tests.conftest import free_port, judged_client
from tests.utils import make_steps, post_batch, register_run


def test_health(client: Client) -> None:
    health = client.health()
    assert health.status == "ok"
    assert health.database in ("sqlite", "postgresql")


def test_runs_are_typed_and_filtered(api, client: Client) -> None:
    seed_healthy(api, "a-healthy", project="alpha")
    seed_diverging(api, "b-diverging")
    runs = client.runs()
    assert {r.id for r in runs} == {"a-healthy", "b-diverging"}
    assert all(isinstance(r, Run) for r in runs)
    healthy = client.run("a-healthy")
    assert (healthy.steps, healthy.last_step, healthy.loss_scale) == (300, 299, 65536.0)
    assert healthy.skip_rate == 0.0
    assert healthy.ranks[0].next_seq == 1
    assert healthy.created_at.tzinfo is not None
    assert [r.id for r in client.runs(project="alpha")] == ["a-healthy"]
    assert [r.id for r in client.runs(name="DIVERG")] == ["b-diverging"]
    assert [r.id for r in client.runs(status="critical")] == ["b-diverging"]


def test_runs_are_fetched_page_by_page(api, client: Client) -> None:
    for i in range(7):
        register_run(api, f"run-{i}", 2)
    client.RUNS_PAGE = 3
    assert sorted(r.id for r in client.runs()) == [f"run-{i}" for i in range(7)]
    assert len(client.runs(limit=5)) == 5


def test_delete_run(api, client: Client) -> None:
    seed_healthy(api, "doomed")
    client.delete_run("doomed")
    with pytest.raises(NotFound, match="doomed"):
        client.run("doomed")


def test_steps_carry_nonfinite_values_exactly(api, client: Client) -> None:
    seed_diverging(api, "d")
    steps = client.steps("d", start=199, end=201)
    assert [s.step for s in steps] == [199, 200, 201]
    assert all(isinstance(s, Step) for s in steps)
    assert steps[0].grad_norm == pytest.approx(1.3) and not steps[0].skipped
    assert steps[1].grad_norm == math.inf and steps[1].skipped
    assert steps[1].scale_after == 32768.0


def test_steps_pages_are_seamless_across_ranks(api, client: Client) -> None:
    register_run(api, "multi", N_LAYERS)
    assert post_batch(api, "multi", 0, make_steps(0, 25, N_LAYERS), rank=0).status_code == 200
    # rank 1 starts later, so a page boundary of rank 0 falls inside its range
    assert post_batch(api, "multi", 0, make_steps(5, 9, N_LAYERS), rank=1).status_code == 200
    client.STEPS_PAGE = 10
    keys = [(s.step, s.rank) for s in client.steps("multi")]
    assert keys == sorted({(s, 0) for s in range(25)} | {(s, 1) for s in range(5, 14)})
    assert [s.step for s in client.steps("multi", rank=1)] == list(range(5, 14))


def test_downsampled_steps_are_at_most_max_points_and_events_are_every_skip(
        api, client: Client) -> None:
    seed_diverging(api, "d")
    steps = client.steps("d", max_points=20)
    assert 0 < len(steps) <= 20
    events = client.step_events("d")
    assert [s.step for s in events] == list(range(200, 260))
    assert all(s.skipped for s in events)


def test_layers_series_and_matrix(api, client: Client) -> None:
    seed_diverging(api, "d")
    layers = client.layers("d")
    assert [x.name for x in layers] == [f"blocks.{i}.fc" for i in range(N_LAYERS)]
    assert all(isinstance(x, Layer) for x in layers)
    assert layers[0].summary.grad_nonfinite_steps == 60
    assert layers[1].attrs == {"in_features": 64, "out_features": 64}

    by_index = client.layer_series("d", 0, start=198, end=201)
    by_name = client.layer_series("d", "blocks.0.fc", start=198, end=201)
    assert by_index == by_name
    assert [p.grad_norm for p in by_index.grad][2:] == [math.inf, math.inf]
    assert [p.step for p in by_index.activations] == [200]
    assert by_index.activations[0].act_dtype == "float16"
    with pytest.raises(NotFound, match="no layer named 'nope'"):
        client.layer_series("d", "nope")

    matrix = client.layer_matrix("d", buckets=26)
    assert matrix.layers == [x.name for x in layers]
    assert len(matrix.values) == N_LAYERS and len(matrix.step_start) == 26
    assert matrix.values[0][-1] == math.inf
    assert math.isfinite(matrix.values[1][-1])


def test_findings_per_run_and_across_runs(api, client: Client) -> None:
    seed_healthy(api, "h")
    seed_diverging(api, "d")
    mine = client.findings("d")
    assert mine and all(isinstance(f, Finding) and f.run_id == "d" for f in mine)
    critical = client.findings("d", severity="critical", status="open")
    assert [f.kind for f in critical] == ["scaler_divergence"]
    assert critical[0].layer == "blocks.0.fc"
    assert not client.findings("h", severity="critical")
    everyone = client.findings()
    assert {f.run_id for f in everyone} == {"h", "d"}
    assert {f.id for f in client.findings(kind="scaler_divergence")} <= {f.id for f in mine}
    client.FINDINGS_PAGE = 1
    assert sorted(f.id for f in client.findings()) == sorted(f.id for f in everyone)
    assert len(client.findings(limit=2)) == 2


def test_to_pandas_types_columns_by_field(api, client: Client) -> None:
    pytest.importorskip("pandas")
    seed_diverging(api, "d")
    frame = client.steps("d").to_pandas()
    assert len(frame) == 260
    assert str(frame["grad_norm"].dtype) == "float64"
    assert str(frame["skipped"].dtype) == "boolean"
    assert str(frame["scheduler_steps"].dtype) == "Int64"
    assert frame["grad_norm"].iloc[200] == math.inf
    assert client.runs().to_pandas()["id"].tolist() == ["d"]
    empty = client.findings("d", kind="speed").to_pandas()
    assert empty.empty and {"severity", "message", "step"} <= set(empty.columns)
    heat = client.layer_matrix("d", buckets=13).to_pandas()
    assert heat.shape == (N_LAYERS, 13) and heat.index.name == "layer"


def test_wait_for_step_follows_a_live_run(api, client: Client) -> None:
    register_run(api, "live", N_LAYERS)
    timer = threading.Timer(
        0.3, lambda: post_batch(api, "live", 0, make_steps(0, 50, N_LAYERS)))
    timer.start()
    try:
        run = client.wait_for_step("live", 40, timeout=10, poll_interval=0.05)
    finally:
        timer.join()
    assert run.last_step == 49
    with pytest.raises(TimeoutError, match="did not reach step 1000"):
        client.wait_for_step("live", 1000, timeout=0.2, poll_interval=0.05)
    with pytest.raises(TimeoutError, match="not registered"):
        client.wait_for_step("ghost", 0, timeout=0.1, poll_interval=0.05)


def test_wait_for_analysis_returns_the_run_once_its_findings_are_in(database_url) -> None:
    app = create_app(Settings(database_url=database_url, embedded_worker=False,
                              analysis_wait_s=0))
    try:
        with TestClient(app) as api:
            seed_diverging(api)
            client = Client(http_client=api)
            assert client.run("diverging").analysis_pending == 1
            with pytest.raises(AnalysisPending, match="analysis of 1 batch still pending") \
                    as caught:
                client.wait_for_analysis("diverging", timeout=0.2, poll_interval=0.05)
            assert caught.value.pending == 1 and isinstance(caught.value, TimeoutError)
            worker = AnalysisWorker(app.state.sessionmaker, app.state.settings)
            timer = threading.Timer(0.3, worker.drain)
            timer.start()
            try:
                run = client.wait_for_analysis("diverging", timeout=30, poll_interval=0.05)
            finally:
                timer.join()
            assert (run.analysis_pending, run.status) == (0, "critical")
    finally:
        app.state.engine.dispose()


def test_reads_with_wait_answer_once_the_runs_findings_are_in(database_url) -> None:
    """`?wait=` (the client's `wait=`): the server holds the read until the worker judged
    the run's stored batches; without it, or past it, the read answers what is in."""
    app = create_app(Settings(database_url=database_url, embedded_worker=False,
                              analysis_wait_s=0))
    try:
        with TestClient(app) as api:
            seed_diverging(api)
            client = Client(http_client=api)
            start = time.monotonic()
            assert not client.findings("diverging", kind="scaler_divergence", wait=0.3)
            assert time.monotonic() - start >= 0.3  # waited it out: nothing judged it
            assert client.run("diverging", wait=0.1).analysis_pending == 1
            worker = AnalysisWorker(app.state.sessionmaker, app.state.settings)
            reads = {
                "run": lambda: client.run("diverging", wait=30).status,
                "findings": lambda: {f.severity for f in client.findings(
                    "diverging", kind="scaler_divergence", wait=30)},
                "all findings": lambda: {f.severity for f in client.findings(
                    kind="scaler_divergence", wait=30)},
                "incidents": lambda: {i.severity for i in client.incidents(
                    "diverging", wait=30)} - {"info"},
            }
            timer = threading.Timer(0.3, worker.drain)
            timer.start()
            try:
                first = reads["run"]()  # the one that waits for the drain
            finally:
                timer.join()
            assert first == "critical"
            assert {name: read() for name, read in reads.items() if name != "run"} == {
                "findings": {"critical"}, "all findings": {"critical"},
                "incidents": {"critical"}}
            assert client.spikes("diverging", wait=30) == []
            # bounded: a minute at most
            assert api.get("/api/v1/runs/diverging/findings?wait=61").status_code == 422
    finally:
        app.state.engine.dispose()


def test_errors_carry_the_server_message(api, client: Client) -> None:
    with pytest.raises(NotFound, match="no run with id 'ghost'") as caught:
        client.run("ghost")
    assert caught.value.status_code == 404
    with pytest.raises(BadRequest, match="status") as caught:
        client.runs(status="bogus")
    assert caught.value.status_code == 422
    register_run(api, "r", N_LAYERS)
    with pytest.raises(BadRequest, match="layer"):
        client.send_batch("r", {"rank": 0, "seq": 0,
                                "steps": [{"step": 0, "layer_grad_norm": [1.0]}]})


def test_send_batch_is_idempotent(api, client: Client) -> None:
    client.register_run("r", {"name": "r", "layers": []})
    batch = {"rank": 0, "seq": 0, "steps": make_steps(0, 3, 0)}
    first = client.send_batch("r", batch)
    again = client.send_batch("r", batch)
    assert (first.duplicate, first.stored_steps) == (False, 3)
    assert again.duplicate


def test_bad_or_missing_token_is_unauthorized(settings) -> None:
    app = create_app(Settings(database_url=settings.database_url, token="s3cret"))
    with judged_client(app) as http:
        assert Client(http_client=http, token="s3cret").runs() == []
        assert Client(http_client=http, token="s3cret").health().status == "ok"
        with pytest.raises(Unauthorized, match="missing or wrong token"):
            Client(http_client=http, token="wrong").runs()
        with pytest.raises(Unauthorized):
            Client(http_client=http, token="").run("x")
    close_app(app)


def test_server_down_is_connection_failed() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", timeout=2) as client, \
            pytest.raises(ConnectionFailed, match="cannot reach"):
        client.health()


def test_base_url_and_token_default_to_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_SERVER", "http://example.invalid:9/")
    monkeypatch.setenv("AMPWATCH_TOKEN", "t0k")
    with Client() as client:
        assert client.base_url == "http://example.invalid:9"
        assert client._headers == {"Authorization": "Bearer t0k"}


@pytest.mark.parametrize("run_id", ["..", "../health", "a/b", "../../api/v1/runs"])
def test_a_run_id_cannot_reach_another_route(api, client: Client, run_id: str) -> None:
    seed_healthy(api, "a-healthy")
    with pytest.raises((NotFound, BadRequest)):
        client.run(run_id)
    with pytest.raises((NotFound, BadRequest)):
        client.delete_run(run_id)
    assert [r.id for r in client.runs()] == ["a-healthy"]


def test_downsampled_layer_series_keeps_its_nonfinite_points_apart(api, client: Client) -> None:
    seed_diverging(api, "d")
    every = client.layer_series("d", 0)
    series = client.layer_series("d", 0, max_points=10)
    assert series.downsampled and len(series.grad) <= 10
    nonfinite = [p.step for p in every.grad if not math.isfinite(p.grad_norm)]
    assert nonfinite and [p.step for p in series.events] == nonfinite
