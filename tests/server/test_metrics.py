"""GET /metrics scraped with prometheus_client's parser while a real agent streams a real
fp16 run (GradScaler on the CPU) into a real server process; the run's numbers are checked
against the training loop's own scaler, and the run drops out once its agent detaches."""

from __future__ import annotations

import threading
import time
from datetime import datetime

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ampwatch import agent
from tests.agent.factories import batches, fp16_loop, mlp
from tests.conftest import LiveServer
from tests.server.alerts.receiver import wait_until
from tests.utils import WAIT

STEPS = 60
POISONED = {20, 21, 40}  # inf in the input batch: the scaler skips these steps


def scrape(url: str, token: str | None = None) -> dict[str, list]:
    """Samples by name, each as (labels, value)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return parsed(httpx.get(f"{url}/metrics", headers=headers, timeout=10))


def parsed(reply) -> dict[str, list]:
    """A /metrics reply's samples by name, each as (labels, value)."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    found = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def train(model, scaler, data, skipped: list[int]) -> None:
    """The fp16 loop, a step at a time; a step whose update lowered the scale was skipped
    (the scaler's own verdict, read by the test, not by the agent)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(data):
        before = scaler.get_scale()
        fp16_loop(model, optimizer, scaler, [batch])
        if scaler.get_scale() < before:
            skipped.append(step)
        time.sleep(0.02)


def check_run_and_server(url: str, labels: dict, scaler, skipped: list[int]) -> None:
    # first a read that waits for the analysis of what was sent (/metrics does not wait)
    findings = httpx.get(f"{url}/api/v1/runs/streaming/findings",
                         params={"status": "open", **WAIT}, timeout=60).json()["items"]
    samples = scrape(url)
    assert value(samples, "ampwatch_run_last_step", **labels) == STEPS - 1
    assert value(samples, "ampwatch_run_steps_total", **labels) == STEPS
    assert value(samples, "ampwatch_run_skipped_steps_total", **labels) == len(skipped)
    assert set(POISONED) <= set(skipped)
    assert value(samples, "ampwatch_run_skip_ratio", **labels) == \
        pytest.approx(len(skipped) / STEPS)
    assert value(samples, "ampwatch_run_loss_scale", **labels) == scaler.get_scale()
    assert 0 <= value(samples, "ampwatch_run_seconds_since_data", **labels) < 60
    for severity in ("info", "warning", "critical"):
        assert value(samples, "ampwatch_run_open_findings", severity=severity, **labels) \
            == sum(f["severity"] == severity for f in findings)
    assert value(samples, "ampwatch_live_runs") == 1

    # the server's own counters, against the run's totals
    rank = httpx.get(f"{url}/api/v1/runs/streaming", timeout=10).json()["ranks"][0]
    assert value(samples, "ampwatch_ingest_batches_total") == rank["batches"] > 1
    assert value(samples, "ampwatch_ingest_steps_total") == STEPS
    assert value(samples, "ampwatch_ingest_requests_total", code="200") == rank["batches"]
    assert value(samples, "ampwatch_ingest_bytes_total") > 0
    assert value(samples, "ampwatch_ingest_duration_seconds_count") == rank["batches"]
    assert value(samples, "ampwatch_analysis_backlog_batches") == 0
    # every stored batch with steps was analysed; the detectors' time is part of ingest's
    assert value(samples, "ampwatch_analysis_duration_seconds_count") == rank["batches"]
    assert 0 < value(samples, "ampwatch_analysis_duration_seconds_sum") \
        < value(samples, "ampwatch_ingest_duration_seconds_sum")
    assert value(samples, "ampwatch_alert_notifications_pending") == 0

    httpx.get(f"{url}/", timeout=30).raise_for_status()
    httpx.get(f"{url}/runs/streaming", timeout=30).raise_for_status()
    samples = scrape(url)
    for page in ("runs", "run"):
        assert value(samples, "ampwatch_page_duration_seconds_count", page=page) == 1


def test_metrics_follow_a_streaming_run_and_drop_it_when_it_finishes(tmp_path):
    torch.set_num_threads(1)
    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log")
    server.start()
    try:
        model = mlp()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        data = batches(STEPS, bad=lambda i: "inf" if i in POISONED else None)
        labels = {"project": "metrics", "run": "streaming"}
        seen_steps: list[float] = []
        skipped: list[int] = []
        with agent.attach(model, scaler, run="streaming", project="metrics",
                          server=server.url, flush_interval=0.05, max_batch_steps=5) as watch:
            trainer = threading.Thread(target=train, args=(model, scaler, data, skipped))
            trainer.start()
            while trainer.is_alive():  # scrape while the run streams
                last = value(scrape(server.url), "ampwatch_run_last_step", **labels)
                if last is not None:
                    seen_steps.append(last)
                time.sleep(0.2)
            trainer.join()
            assert watch.flush(15)
            assert len(set(seen_steps)) >= 2 and seen_steps == sorted(seen_steps), seen_steps
            check_run_and_server(server.url, labels, scaler, skipped)

        # detached: the agent's "finished" event takes the run out at once
        wait_until(lambda: value(scrape(server.url), "ampwatch_live_runs") == 0, 10,
                   lambda: "the run stayed live")
        samples = scrape(server.url)
        assert not any(lab.get("run") == "streaming" for series in samples.values()
                       for lab, _ in series)
        assert value(samples, "ampwatch_ingest_steps_total") == STEPS  # the server's stay
    finally:
        server.stop()


@pytest.mark.parametrize(("token", "metrics_token", "accepted", "refused"), [
    (None, None, [None], []),
    ("api-token", None, ["api-token"], [None, "wrong"]),
    ("api-token", "scrape-token", ["api-token", "scrape-token"], [None, "wrong"]),
    (None, "scrape-token", ["scrape-token"], [None, "wrong"]),
])
def test_metrics_want_a_token_when_one_is_set(tmp_path, token, metrics_token, accepted,
                                              refused):
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings
    from tests.conftest import judged_client

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}", token=token,
                              metrics_token=metrics_token))
    with judged_client(app) as client:
        for supplied in accepted:
            headers = {"Authorization": f"Bearer {supplied}"} if supplied else {}
            reply = client.get("/metrics", headers=headers)
            assert reply.status_code == 200, reply.text
            assert "ampwatch_live_runs 0.0" in reply.text
        for supplied in refused:
            headers = {"Authorization": f"Bearer {supplied}"} if supplied else {}
            assert client.get("/metrics", headers=headers).status_code == 401
    close_app(app)


def reads_as_the_api(samples: dict, run: dict) -> None:
    """/metrics tells the run's state as `GET /api/v1/runs/{id}` does: where it stands,
    when it was last seen, the steps it lost."""
    labels = {"project": run["project"], "run": run["id"]}
    for state in ("live", "stopped"):
        assert value(samples, "ampwatch_run_reporting", state=state, **labels) == \
            float(run["reporting"] == state), (state, run["reporting"])
    assert value(samples, "ampwatch_run_last_seen_timestamp_seconds", **labels) == \
        pytest.approx(datetime.fromisoformat(run["last_seen_at"]).timestamp(), abs=1e-3)
    assert value(samples, "ampwatch_run_steps_lost", **labels) == run["steps_lost"]
    assert value(samples, "ampwatch_run_last_step", **labels) == run["last_step"]


def test_a_quiet_run_reads_stopped_as_the_api_says_then_drops_out(tmp_path):
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings
    from tests.conftest import judged_client
    from tests.utils import make_steps, post_batch, register_run

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}", live_seconds=4,
                              metrics_stopped_seconds=8))
    with judged_client(app) as api:
        register_run(api, "quiet", n_layers=2)
        assert post_batch(api, "quiet", 0, make_steps(0, 10, 2)).status_code == 200
        # the agent's heartbeat: the loop reached step 15, steps 10..15 never arrive
        assert api.post("/api/v1/runs/quiet/ranks/0/reached",
                        json={"reached_step": 15}).status_code == 204
        live = api.get("/api/v1/runs/quiet").json()
        assert (live["reporting"], live["steps_lost"]) == ("live", 6)
        samples = parsed(api.get("/metrics"))
        reads_as_the_api(samples, live)
        assert value(samples, "ampwatch_live_runs") == 1
        assert value(samples, "ampwatch_stopped_runs") == 0

        time.sleep(4.2)  # quiet past live_seconds, never finished: killed, hung, an eval
        stopped = api.get("/api/v1/runs/quiet").json()
        assert stopped["reporting"] == "stopped"
        samples = parsed(api.get("/metrics"))
        reads_as_the_api(samples, stopped)
        labels = {"project": "tests", "run": "quiet"}
        assert value(samples, "ampwatch_run_seconds_since_data", **labels) >= 4
        assert value(samples, "ampwatch_live_runs") == 0
        assert value(samples, "ampwatch_stopped_runs") == 1

        time.sleep(4)  # its data is older than metrics_stopped_seconds: it is left out
        samples = parsed(api.get("/metrics"))
        assert not any(lab.get("run") == "quiet" for series in samples.values()
                       for lab, _ in series)
        assert value(samples, "ampwatch_stopped_runs") == 0
        assert api.get("/api/v1/runs/quiet").json()["reporting"] == "stopped"
    close_app(app)


def test_a_finished_run_is_in_no_gauge_at_once(tmp_path):
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings
    from tests.conftest import judged_client
    from tests.utils import make_steps, post_batch, register_run

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'm.db'}"))
    with judged_client(app) as api:
        register_run(api, "done", n_layers=2)
        assert post_batch(api, "done", 0, make_steps(0, 10, 2),
                          events=[{"kind": "finished"}]).status_code == 200
        assert api.get("/api/v1/runs/done").json()["reporting"] == "finished"
        samples = parsed(api.get("/metrics"))
        assert not any(lab.get("run") == "done" for series in samples.values()
                       for lab, _ in series)
        assert value(samples, "ampwatch_live_runs") == 0
        assert value(samples, "ampwatch_stopped_runs") == 0
    close_app(app)
