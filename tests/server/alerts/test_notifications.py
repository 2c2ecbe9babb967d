"""Findings turn into notifications through the real app, database and dispatcher, sent
to a real HTTP receiver on 127.0.0.1: once per finding and escalation, never for healthy
runs, retried until a target that was down comes back."""

from __future__ import annotations

import time

import pytest

from ampwatch.wire import encode_tree
from tests.server.alerts.receiver import wait_until
from tests.server.analysis.factories import scaler_steps
from tests.utils import make_layers, make_steps, register_run

ENV = {"autocast_dtype": "float16", "scaler": {"growth_interval": 2000, "enabled": True}}


def post(api, run_id, steps, first_seq=0, per_batch=10):
    for i in range(0, len(steps), per_batch):
        body = {"rank": 0, "seq": first_seq + i // per_batch,
                "steps": encode_tree(steps[i:i + per_batch])}
        response = api.post(f"/api/v1/runs/{run_id}/batches", json=body)
        assert response.status_code == 200, response.text


def findings(api, run_id, **filters):
    response = api.get(f"/api/v1/runs/{run_id}/findings", params=filters)
    assert response.status_code == 200, response.text
    return response.json()["items"]


def deliveries(api, **filters):
    response = api.get("/api/v1/alerts/deliveries", params=filters)
    assert response.status_code == 200, response.text
    return response.json()["items"]


def settled(api, timeout=20.0):
    """Deliveries once none is pending any more."""
    wait_until(lambda: not deliveries(api, status="pending"), timeout,
               lambda: f"pending: {deliveries(api, status='pending')}")
    return deliveries(api)


def diverging_run(api, run_id="r1", project="llm"):
    register_run(api, run_id, project=project, layers=make_layers(4), environment=ENV)
    # the scaler overflows on every step from 200 on: a skip streak that becomes a warning
    # at 5 steps and critical at 20, while batches of 10 steps arrive
    post(api, run_id, scaler_steps(300, overflow=range(200, 300), init_scale=2.0**40))


def streak_of(items):
    return [n for n in items if n["finding"]["kind"] == "scaler_divergence"
            and n["finding"]["evidence"].get("check") == "skip_streak"]


@pytest.mark.parametrize("alert_app", [{"per": "finding"}], indirect=True)
def test_a_persisting_finding_notifies_once_and_once_per_escalation(alert_api, receiver):
    diverging_run(alert_api)
    serious = [f for f in findings(alert_api, "r1") if f["severity"] != "info"]
    assert serious, "the diverging run raised no finding"
    settled(alert_api)
    got = receiver.accepted
    # every warning/critical finding announced exactly once when it opened
    opened = sorted(n["finding"]["id"] for n in got if n["event"] == "opened")
    assert opened == sorted(f["id"] for f in serious)
    # the streak: warning after 5 skipped steps, critical after 20; 100 steps long
    streak = streak_of(got)
    assert [(n["event"], n["finding"]["severity"]) for n in streak] == \
        [("opened", "warning"), ("escalated", "critical")]
    assert {n["event"] for n in got} <= {"opened", "escalated"}
    first = streak[0]
    assert first["run"] == {"id": "r1", "name": "r1", "project": "llm",
                            "url": "https://ampwatch.example.com/runs/r1"}
    assert first["source"] == "ampwatch" and first["rule"] == "page-me"
    assert "skip" in first["finding"]["message"]
    # a stable id per notification, also as the Idempotency-Key header
    ids = [n["notification_id"] for n in got]
    assert len(set(ids)) == len(ids)
    assert [h["Idempotency-Key"] for h in receiver.headers] == [f"ampwatch-{i}" for i in ids]

    # 300 more overflowing steps: the findings persist, nothing more is sent
    post(alert_api, "r1", scaler_steps(300, first=300, overflow=range(300, 600),
                                       init_scale=1.0), first_seq=30)
    assert findings(alert_api, "r1", kind="scaler_divergence", status="open")
    before = len(got)
    items = settled(alert_api)
    assert len(receiver.accepted) == before == len(items)
    assert all(d["status"] == "delivered" and d["attempts"] == 1 for d in items)


@pytest.mark.parametrize("alert_app", [{"on_resolve": True, "per": "finding"}], indirect=True)
def test_resolution_is_announced_when_the_rule_asks(alert_api, receiver):
    diverging_run(alert_api)
    post(alert_api, "r1", scaler_steps(200, first=300, init_scale=1024.0), first_seq=30)
    settled(alert_api)
    streak = streak_of(receiver.accepted)
    assert [n["event"] for n in streak] == ["opened", "escalated", "resolved"]
    assert streak[-1]["finding"]["status"] == "resolved"


@pytest.mark.parametrize("alert_app", [{"projects": ["vision"]}], indirect=True)
def test_rules_filter_by_project(alert_api, receiver):
    diverging_run(alert_api, "r1", project="llm")
    diverging_run(alert_api, "r2", project="vision")
    items = settled(alert_api)
    assert items and {d["run_id"] for d in items} == {"r2"}
    assert {n["run"]["project"] for n in receiver.accepted} == {"vision"}


@pytest.mark.parametrize("alert_app", [{"severity": "critical", "per": "finding",
                                        "kinds": ["scaler_divergence"]}], indirect=True)
def test_rules_filter_by_severity_and_kind(alert_api, receiver):
    diverging_run(alert_api)
    settled(alert_api)
    got = receiver.accepted
    assert got and {(n["finding"]["kind"], n["finding"]["severity"]) for n in got} == \
        {("scaler_divergence", "critical")}
    # the streak reached the rule's severity when it escalated: for this rule it opened then
    assert [n["event"] for n in streak_of(got)] == ["opened"]


def test_a_healthy_run_notifies_nobody(alert_api, receiver):
    register_run(alert_api, "healthy", layers=make_layers(4), environment=ENV)
    post(alert_api, "healthy", make_steps(0, 600, 4), per_batch=50)
    assert all(f["severity"] == "info" for f in findings(alert_api, "healthy"))
    # a test notification goes through the same outbox: once it arrived, anything the
    # healthy run had queued before it would have too
    reply = alert_api.post("/api/v1/alerts/test")
    assert reply.status_code == 200, reply.text
    receiver.wait_for(1)
    items = settled(alert_api)
    assert [n["event"] for n in receiver.accepted] == ["test"]
    assert [d["event"] for d in items] == ["test"]


def test_a_target_down_then_back_gets_exactly_one_notification(alert_api, receiver):
    receiver.stop()
    register_run(alert_api, "r1", layers=make_layers(4), environment=ENV)
    post(alert_api, "r1", scaler_steps(230, overflow=range(200, 230), init_scale=2.0**40),
         per_batch=230)
    wait_until(lambda: any(d["attempts"] >= 2 for d in deliveries(alert_api)), 20,
               lambda: str(deliveries(alert_api)))
    receiver.fail_next(2, status=503)  # back, but answering errors at first
    receiver.start()
    items = settled(alert_api, timeout=30)
    announced = [n["finding"]["id"] for n in receiver.accepted]
    assert sorted(announced) == sorted(d["finding_id"] for d in items)
    assert len(set(announced)) == len(announced)
    for item in items:
        assert item["status"] == "delivered"
        history = item["history"]
        assert [a["ok"] for a in history] == [False] * (len(history) - 1) + [True]
        assert history[-1]["status_code"] == 200
    failures = [a for d in items for a in d["history"] if not a["ok"]]
    assert any(a["status_code"] is None and a["error"] for a in failures)  # refused
    assert any(a["status_code"] == 503 for a in failures)
    assert receiver.requests == len(announced) + 2


def test_a_slow_target_does_not_hold_up_ingest(alert_api, receiver):
    receiver.delay = 2.0
    register_run(alert_api, "r1", layers=make_layers(4), environment=ENV)
    alert_api.post("/api/v1/alerts/test")  # the dispatcher is now busy for 2 s
    start = time.perf_counter()
    post(alert_api, "r1", scaler_steps(230, overflow=range(200, 230), init_scale=2.0**40),
         per_batch=230)
    elapsed = time.perf_counter() - start
    assert len(deliveries(alert_api)) > 1, "the finding queued no notification"
    assert elapsed < 1.5, f"ingest took {elapsed:.2f} s"


def test_alert_routes_need_the_token(database_url, receiver):
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings
    from tests.conftest import judged_client
    from tests.server.alerts.conftest import alert_config

    app = create_app(Settings(database_url=database_url, token="t0ken",
                              alerts=alert_config(receiver.url)))
    with judged_client(app) as api:
        for method, path in [("get", "/api/v1/alerts"), ("get", "/api/v1/alerts/deliveries"),
                             ("get", "/api/v1/alerts/deliveries/1"),
                             ("post", "/api/v1/alerts/test")]:
            assert api.request(method, path).status_code == 401, path
        auth = {"Authorization": "Bearer t0ken"}
        shown = api.get("/api/v1/alerts", headers=auth).json()
        assert shown["targets"][0]["url"] == f"http://127.0.0.1:{receiver.port}/..."
        assert api.post("/api/v1/alerts/test", params={"target": "nope"},
                        headers=auth).status_code == 404
        assert api.get("/api/v1/alerts/deliveries/99", headers=auth).status_code == 404
    close_app(app)


def test_without_targets_a_test_is_refused(api):
    reply = api.post("/api/v1/alerts/test")
    assert reply.status_code == 409 and "no alert targets" in reply.json()["detail"]
    assert api.get("/api/v1/alerts").json() == {
        "enabled": False, "public_url": "http://127.0.0.1:8000", "rules": [], "targets": []}
