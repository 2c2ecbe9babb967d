"""Alerts follow "Mark handled" as every count does: an incident a person marked handled
is open to no rule, so it sends nothing while handled (not even its resolution), and its
signal returning after the mark sends one "reopened". What a user receives is read at a
real receiver; the incidents come from real batches of a simulated GradScaler whose
layer's gradients the test made inf."""

from __future__ import annotations

import pytest

from tests.server.alerts.test_incident_alerts import LAYERS, overflowing_run
from tests.server.alerts.test_notifications import ENV, post, settled
from tests.server.analysis.factories import scaler_steps
from tests.utils import register_run


def mark_handled(api, run_id: str, incident: int) -> None:
    reply = api.post(f"/api/v1/runs/{run_id}/notes",
                     json={"incident": incident, "handled": True, "text": "on it"})
    assert reply.status_code == 201, reply.text


def incident_status(api, run_id: str, incident: int) -> str:
    items = api.get(f"/api/v1/runs/{run_id}/incidents").json()["items"]
    return next(i["status"] for i in items if i["id"] == incident)


def events(receiver) -> list[tuple[str, int, str]]:
    return [(n["event"], n["incident"]["id"], n["incident"]["severity"])
            for n in receiver.accepted]


def test_a_handled_incident_sends_one_reopened_when_its_signal_returns(alert_api, receiver):
    overflowing_run(alert_api)  # layer 0 overflows on steps 200..299
    settled(alert_api)
    incident = receiver.accepted[0]["incident"]["id"]
    assert events(receiver) == [("opened", incident, "warning"),
                                ("escalated", incident, "critical")]
    mark_handled(alert_api, "r1", incident)
    assert incident_status(alert_api, "r1", incident) == "handled"
    assert alert_api.get("/api/v1/runs/r1").json()["open_problems"] == 0

    # the overflow goes on after the mark: the incident is open again, and said so once
    post(alert_api, "r1", scaler_steps(100, first=300, overflow=range(300, 400),
                                       init_scale=1.0), first_seq=30)
    settled(alert_api)
    assert incident_status(alert_api, "r1", incident) == "open"
    assert events(receiver)[2:] == [("reopened", incident, "critical")]
    reopened = receiver.accepted[2]
    assert reopened["title"].startswith("ampwatch reopened: critical: ")
    assert reopened["incident"]["status"] == "open"

    # it persists: nothing more, as for any open incident
    post(alert_api, "r1", scaler_steps(100, first=400, overflow=range(400, 500),
                                       init_scale=1.0), first_seq=40)
    settled(alert_api)
    assert len(receiver.accepted) == 3


@pytest.mark.parametrize("alert_app", [{"on_resolve": True}], indirect=True)
def test_a_handled_incident_is_quiet_while_handled_even_when_it_resolves(alert_api,
                                                                       receiver):
    register_run(alert_api, "r1", project="llm", layers=LAYERS, environment=ENV)
    post(alert_api, "r1", scaler_steps(300, overflow=range(200, 300), init_scale=2.0**40,
                                       grad_layer=0))
    settled(alert_api)
    first = receiver.accepted[0]["incident"]["id"]
    assert [e for e, _, _ in events(receiver)] == ["opened", "escalated"]
    mark_handled(alert_api, "r1", first)

    # healthy steps resolve it (unhandled, it would send "resolved": the rule asks), then
    # long after (past the findings' merge gap) another layer overflows: a new incident
    post(alert_api, "r1", scaler_steps(700, first=300, init_scale=1024.0), first_seq=30)
    post(alert_api, "r1", scaler_steps(100, first=1000, overflow=range(1000, 1030),
                                       init_scale=2.0**20, grad_layer=2), first_seq=100)
    settled(alert_api)
    assert incident_status(alert_api, "r1", first) == "resolved"
    later = [(e, i) for e, i, _ in events(receiver)[2:]]
    assert later and all(i != first for _, i in later), later
    assert later[0][0] == "opened"
    assert receiver.accepted[2]["incident"]["layer"] == LAYERS[2]["name"]


def test_unmarking_sends_nothing_and_the_earlier_announcement_stands(alert_api, receiver):
    overflowing_run(alert_api)
    settled(alert_api)
    incident = receiver.accepted[0]["incident"]["id"]
    mark_handled(alert_api, "r1", incident)
    note = alert_api.get("/api/v1/runs/r1/notes").json()["items"][-1]
    assert alert_api.delete(f"/api/v1/runs/r1/notes/{note['id']}").status_code == 204
    assert incident_status(alert_api, "r1", incident) == "open"
    # open again by a person, not by its signal: nothing is sent, and the overflow going
    # on is the same incident, announced already
    post(alert_api, "r1", scaler_steps(100, first=300, overflow=range(300, 400),
                                       init_scale=1.0), first_seq=30)
    settled(alert_api)
    assert [e for e, _, _ in events(receiver)] == ["opened", "escalated"]
