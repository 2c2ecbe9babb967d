"""Alerts follow incidents: one root cause (one layer's overflowing gradients raise a
non-finite finding, a skip streak and a scale collapse) is one notification when it
opens, one when it escalates and one when it resolves, naming the cause, the layer, the
first step, the fix and the run page. The ground truth is the test's own series: which
layer's gradients it made inf, from which step."""

from __future__ import annotations

import pytest

from ampwatch.server.alerts.senders import notification_body
from tests.server.alerts.test_notifications import (
    ENV,
    deliveries,
    findings,
    post,
    settled,
)
from tests.server.analysis.factories import scaler_steps
from tests.utils import make_layers, register_run

LAYERS = make_layers(4)


def overflowing_run(api, run_id: str = "r1", *, layer: int = 0, start: int = 200,
                    end: int = 300, healthy_after: int = 0) -> None:
    """Layer `layer`'s gradients are inf on steps start..end-1 (batches of 10 steps),
    then `healthy_after` clean steps follow."""
    register_run(api, run_id, project="llm", layers=LAYERS, environment=ENV)
    post(api, run_id, scaler_steps(end, overflow=range(start, end), init_scale=2.0**40,
                                   grad_layer=layer))
    if healthy_after:
        post(api, run_id, scaler_steps(healthy_after, first=end, init_scale=1024.0),
             first_seq=end // 10)


def test_one_cause_is_one_notification_per_change_not_one_per_finding(alert_api, receiver):
    overflowing_run(alert_api)
    serious = [f for f in findings(alert_api, "r1") if f["severity"] != "info"]
    assert len(serious) >= 2, "the run should raise several findings of one cause"
    settled(alert_api)
    got = receiver.accepted
    assert [(n["event"], n["incident"]["severity"]) for n in got] == \
        [("opened", "warning"), ("escalated", "critical")]
    incident = got[-1]["incident"]
    assert incident["cause"] == "grad_overflow"
    assert incident["layer"] == LAYERS[0]["name"]
    assert incident["step"] == 200
    assert incident["fix"] and incident["headline"]
    # the incident as it stands now holds every serious finding (the payload is frozen
    # at the change: a scale collapse that came later without one is not in it)
    now = alert_api.get("/api/v1/runs/r1/incidents").json()["items"]
    assert {f["id"] for f in serious} <= set(next(i for i in now
                                                 if i["id"] == incident["id"])["findings"])
    assert incident["url"].startswith("https://ampwatch.example.com/runs/r1?")
    assert LAYERS[0]["name"] in got[0]["title"] and "from step 200" in got[0]["title"]
    # one incident: every notification is keyed by its id
    assert {d["finding_id"] for d in deliveries(alert_api)} == {incident["id"]}

    # 300 more overflowing steps: the incident persists, nothing more is sent
    post(alert_api, "r1", scaler_steps(300, first=300, overflow=range(300, 600),
                                       init_scale=1.0), first_seq=30)
    settled(alert_api)
    assert len(receiver.accepted) == 2


@pytest.mark.parametrize("alert_app", [{"on_resolve": True}], indirect=True)
def test_an_incident_resolves_once_when_its_last_finding_does(alert_api, receiver):
    overflowing_run(alert_api, healthy_after=200)
    assert not findings(alert_api, "r1", status="open", severity="critical")
    settled(alert_api)
    got = receiver.accepted
    assert [n["event"] for n in got] == ["opened", "escalated", "resolved"]
    assert got[-1]["incident"]["status"] == "resolved"
    assert len({n["incident"]["id"] for n in got}) == 1


def test_two_causes_are_two_incidents(alert_api, receiver):
    register_run(alert_api, "r1", project="llm", layers=LAYERS, environment=ENV)
    # layer 0 overflows on 200..229, then, long after (past the findings' merge gap),
    # layer 2 on 1000..1029
    steps = scaler_steps(500, overflow=range(200, 230), init_scale=2.0**40, grad_layer=0)
    steps += scaler_steps(600, first=500, overflow=range(1000, 1030), init_scale=2.0**20,
                          grad_layer=2)
    post(alert_api, "r1", steps, per_batch=50)
    settled(alert_api)
    opened = [n["incident"] for n in receiver.accepted if n["event"] == "opened"]
    assert [(i["layer"], i["step"]) for i in opened] == \
        [(LAYERS[0]["name"], 200), (LAYERS[2]["name"], 1000)]


@pytest.mark.parametrize("alert_app", [{"severity": "critical",
                                        "kinds": ["scaler_divergence"]}], indirect=True)
def test_rules_still_match_on_severity_and_kind(alert_api, receiver):
    overflowing_run(alert_api)
    settled(alert_api)
    got = receiver.accepted
    # the incident reached critical through its scaler findings: for this rule it opened then
    assert [(n["event"], n["incident"]["severity"]) for n in got] == [("opened", "critical")]
    assert got[0]["finding"]["kind"] == "scaler_divergence"


@pytest.mark.parametrize("alert_app", [{"kinds": ["nonfinite"]}], indirect=True)
def test_an_incident_below_the_rule_for_its_kinds_is_quiet(alert_api, receiver):
    overflowing_run(alert_api)
    # its non-finite finding is only info; the critical findings are of other kinds
    assert {f["severity"] for f in findings(alert_api, "r1", kind="nonfinite")} == {"info"}
    assert not deliveries(alert_api)


def test_the_chat_body_names_cause_layer_first_step_fix_and_link(alert_api, receiver):
    overflowing_run(alert_api)
    settled(alert_api)
    payload = receiver.accepted[0]
    body = notification_body(payload)
    incident = payload["incident"]
    for part in (incident["headline"], "grad overflow", f"layer: {LAYERS[0]['name']}",
                 "first step: 200", f"Fix: {incident['fix']}", incident["url"]):
        assert part in body, (part, body)
