"""Writing the alert outbox: every change of a finding's status or severity, made by any
session of the app, is matched against the rules in the same flush, and the
notifications it calls for are inserted in the same transaction. A finding change that
commits has its notifications; one that rolls back has none.

A rule follows incidents by default (alerts/incidents.py): the incident, the findings of
one root cause, is what opens, escalates and resolves below. With `per = "finding"`,
each finding does. When a finding (or incident) notifies, per rule:
- it opens (or is found already over, within one batch) at or above the rule's severity:
  "opened", once;
- while open it rises above the severity it was last announced at: "escalated";
- it resolves after an announcement and the rule has `on_resolve`: "resolved" (a later
  reopening announces it again). Without `on_resolve` a reopened finding stays quiet.
A finding that persists for 10,000 steps changes neither status nor severity, so it
notifies once. What was announced is read back from the outbox itself.

An incident marked handled (server/findings/handled.py) is open to no rule per incident:
nothing it does is announced while it is handled, and the mark forgets what was
announced before it. Its signal returning (any change of one of its findings after the
mark, a step more of the same condition included) announces it as "reopened", once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import event, insert, inspect, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server.alerts.incidents import (
    announced_severities,
    incident_json,
    incident_state,
    rule_members,
    run_incidents,
)
from ampwatch.server.alerts.settings import AlertRule, AlertSettings
from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.findings.handled import HANDLED, has_marks, marked_at
from ampwatch.server.models import AlertNotification, Finding, Run, utcnow

OPEN, RESOLVED = "open", "resolved"
TEST_RULE = "test"
# set on a session whose transaction wrote notifications: wake the dispatcher on commit
_WROTE = "alerts_wrote"

Transition = tuple[Finding, tuple[str, str] | None, tuple[str, str]]


class AlertOutbox:
    """Turns finding changes into outbox rows; `install` hooks it into a sessionmaker.

    Costs nothing per flush that changes no finding; a changed finding that matches a rule
    costs one indexed read of its earlier notifications. A flush that only moves open
    findings on (a later step, a higher count) costs, with rules per incident, one
    indexed lookup of the run's handled marks, and is judged only when there are some.
    """

    def __init__(self, settings: AlertSettings, public_url: str,
                 on_commit: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.public_url = public_url.rstrip("/")
        self.on_commit = on_commit

    def install(self, maker: sessionmaker) -> None:
        event.listen(maker, "after_flush", self._after_flush)
        event.listen(maker, "after_commit", self._after_commit)

    def _after_commit(self, session: Session) -> None:
        if session.info.pop(_WROTE, False) and self.on_commit is not None:
            self.on_commit()

    def _after_flush(self, session: Session, _flush_context: Any) -> None:
        # after the flush the new findings have ids, and the attribute history still
        # holds each finding's state before it
        if not self.settings.rules:
            return
        by_run: dict[str, list[Transition]] = {}
        for transition in _finding_transitions(session):
            by_run.setdefault(transition[0].run_id, []).append(transition)
        if not by_run:
            return
        connection = session.connection()
        per_incident_rules = any(r.per == "incident" for r in self.settings.rules)
        rows = []
        for run_id, changed in by_run.items():
            # a finding only moved on (same status and severity) matters to an incident
            # marked handled alone: it is its signal returning
            if all(before == after for _, before, after in changed) and not (
                    per_incident_rules and has_marks(connection, run_id)):
                continue
            run = _run_info(connection, run_id)
            rules = [r for r in self.settings.rules
                     if not r.projects or run["project"] in r.projects]
            per_finding = [r for r in rules if r.per == "finding"]
            per_incident = [r for r in rules if r.per == "incident"]
            for finding, before, after in changed if per_finding else ():
                if before != after:
                    rows += self._notifications(connection, per_finding, finding, before,
                                                after, run)
            if per_incident:
                rows += self._incident_notifications(connection, per_incident, changed, run)
        if rows:
            connection.execute(insert(AlertNotification), rows)
            session.info[_WROTE] = True

    def _notifications(self, connection: Connection, rules: list[AlertRule],
                       finding: Finding, before: tuple[str, str] | None,
                       after: tuple[str, str], run: dict[str, str]) -> list[dict[str, Any]]:
        rules = [r for r in rules if not r.kinds or finding.kind in r.kinds]
        if not rules:
            return []
        announced = {} if before is None else announced_severities(
            connection, finding.id, finding.run_id, _iso(finding.created_at), "finding")
        rows = []
        for rule in rules:
            what = _event(rule, before, after, announced.get(rule.name))
            if what is None:
                continue
            payload = notification_payload(what, rule.name, _finding_json(finding), run,
                                           self.public_url)
            rows += [_row(what, rule.name, target, payload, finding.id, finding.run_id,
                          finding.severity) for target in rule.targets]
        return rows

    def _incident_notifications(self, connection: Connection, rules: list[AlertRule],
                                changed: list[Transition],
                                run: dict[str, str]) -> list[dict[str, Any]]:
        before = {finding.id: was for finding, was, now in changed if was != now}
        moved = {finding.id for finding, _, _ in changed}
        incidents, findings, marks = run_incidents(connection, run["id"],
                                                   (f.rank for f, _, _ in changed))
        rows = []
        for incident in incidents:
            if incident.status == HANDLED:  # open nowhere, so to no rule
                continue
            since = marked_at(incident, marks)
            # after a mark, any change is its signal returning; else only a new status
            # or severity is news
            news = moved if since is not None else before.keys()
            if news.isdisjoint(incident.findings):
                continue
            lead = findings[incident.id]
            created = _iso(lead["created_at"])
            announced = None
            for rule in rules:
                members = rule_members(rule, incident, findings)
                if news.isdisjoint(m["id"] for m in members):
                    continue
                was, now = incident_state(members, before)
                if announced is None:
                    announced = announced_severities(connection, incident.id,
                                                     incident.run_id, created, since=since)
                what = _event(rule, was, now, announced.get(rule.name))
                if what is None:
                    continue
                if what == "opened" and since is not None:
                    what = "reopened"  # announced again after a person marked it handled
                worst = max(members, key=lambda m: (m["status"] == OPEN,
                                                    SEVERITY_RANK[m["severity"]]))
                payload = notification_payload(what, rule.name, _finding_json(worst), run,
                                               self.public_url)
                payload["incident"] = incident_json(incident, now, created,
                                                    payload["run"]["url"], lead["message"])
                payload["title"] = incident_title(what, payload["incident"], run)
                rows += [_row(what, rule.name, target, payload, incident.id, run["id"],
                              now[1]) for target in rule.targets]
        return rows

    def enqueue_test(self, session: Session, targets: Iterable[str]) -> list[int]:
        """Queue a test notification to each of `targets`; the caller commits. Returns
        the new notification ids."""
        payload = notification_payload(
            "test", TEST_RULE,
            {"kind": "test", "severity": "info", "status": OPEN,
             "message": "ampwatch test notification: this target is reachable"},
            {"id": None, "name": None, "project": None}, self.public_url)
        ids = []
        for target in targets:
            row = AlertNotification(event="test", rule=TEST_RULE, target=target,
                                    severity="info", payload=payload)
            session.add(row)
            session.flush()
            ids.append(row.id)
        session.info[_WROTE] = True
        return ids


def _finding_transitions(session: Session) -> Iterable[Transition]:
    """(finding, (status, severity) before or None when new, (status, severity) now) of
    each finding the flush wrote; before == now when it only moved on (steps, count)."""
    for obj in session.new:
        if isinstance(obj, Finding):
            yield obj, None, (obj.status, obj.severity)
    for obj in session.dirty:
        if not isinstance(obj, Finding):
            continue
        state = inspect(obj)
        if session.is_modified(obj):
            yield obj, (_previous(state, "status"), _previous(state, "severity")), \
                (obj.status, obj.severity)


def _previous(state: Any, name: str) -> Any:
    history = state.attrs[name].history
    if history.deleted:
        return history.deleted[0]
    return getattr(state.object, name)


def _event(rule: AlertRule, before: tuple[str, str] | None, after: tuple[str, str],
           announced: str | None) -> str | None:
    """The event this change is for `rule`, given the severity the finding was last
    announced at under it (None: not announced, or its resolution was)."""
    status, severity = after
    if status == OPEN or (before is None and status == RESOLVED):
        if SEVERITY_RANK[severity] < SEVERITY_RANK[rule.severity]:
            return None
        if announced is None:
            return "opened"
        return "escalated" if SEVERITY_RANK[severity] > SEVERITY_RANK[announced] else None
    was_open = before is not None and before[0] == OPEN
    if status == RESOLVED and was_open and announced is not None and rule.on_resolve:
        return "resolved"
    return None


def _run_info(connection: Connection, run_id: str) -> dict[str, str]:
    row = connection.execute(select(Run.name, Run.project).where(Run.id == run_id)).first()
    name, project = row if row is not None else (run_id, "")
    return {"id": run_id, "name": name, "project": project}


def _iso(moment: datetime | None) -> str | None:
    """UTC ISO 8601 with a Z; SQLite hands back naive UTC, Postgres the session's zone."""
    if moment is None:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment.isoformat() + "Z"


FINDING_FIELDS = ("id", "kind", "code", "severity", "status", "rank", "step", "last_step",
                  "layer", "message", "count")


def _finding_json(finding: Finding | Mapping[str, Any]) -> dict[str, Any]:
    """A finding (ORM object or row mapping) as the payload's `finding` object."""
    get = finding.__getitem__ if isinstance(finding, Mapping) else \
        lambda name: getattr(finding, name)
    return {**{name: get(name) for name in FINDING_FIELDS},
            "evidence": get("evidence") or {}, "created_at": _iso(get("created_at"))}


def notification_payload(what: str, rule: str, finding: dict[str, Any],
                         run: dict[str, Any], public_url: str) -> dict[str, Any]:
    """The JSON a webhook receives (the `notification_id` is added when it is sent).
    Documented in docs/alerts.md."""
    link = f"{public_url}/runs/{run['id']}" if run.get("id") else f"{public_url}/"
    return {
        "source": "ampwatch", "event": what, "rule": rule,
        "title": notification_title(what, finding, run),
        "finding": finding, "run": {**run, "url": link},
        "created_at": _iso(utcnow()),
    }


def notification_title(what: str, finding: dict[str, Any], run: dict[str, Any]) -> str:
    if what == "test":
        return "ampwatch: test notification"
    where = f"run {run['name']}" + (f" ({run['project']})" if run.get("project") else "")
    at = f" at step {finding['step']}" if finding.get("step") is not None else ""
    layer = f" in {finding['layer']}" if finding.get("layer") else ""
    return f"ampwatch {what}: {finding['severity']} {finding['kind']}{layer} in {where}{at}"


def incident_title(what: str, incident: dict[str, Any], run: dict[str, Any]) -> str:
    """"ampwatch opened: critical: Layer 'fc2' overflows fp16 ... in run R (P) from step 145"."""
    where = f"run {run['name']}" + (f" ({run['project']})" if run.get("project") else "")
    at = f" from step {incident['step']}" if incident.get("step") is not None else ""
    return f"ampwatch {what}: {incident['severity']}: {incident['headline']} in {where}{at}"


def _row(what: str, rule: str, target: str, payload: dict[str, Any], finding_id: int,
         run_id: str, severity: str) -> dict[str, Any]:
    """An outbox row; `finding_id` is the incident's id for a rule per incident."""
    now = utcnow()
    return {"event": what, "rule": rule, "target": target, "finding_id": finding_id,
            "run_id": run_id, "severity": severity, "payload": payload,
            "status": "pending", "attempts": 0, "next_attempt_at": now, "created_at": now}
