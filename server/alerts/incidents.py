"""Alerts that follow incidents: a rule with `per = "incident"` (the default) notifies
when an incident (the findings of one root cause, server/findings/incidents.py) opens,
escalates or resolves, not once per finding. The fp16 overflow of one layer raises a
non-finite finding, a skip streak and a scale collapse: one incident, one notification.

An incident is judged per rule on its findings of the rule's kinds: open while one of
them is, as severe as the worst of them that is open (of all once resolved). What was
announced is read back from the outbox, keyed by the incident's id (its earliest
finding), exactly as per-finding rules key by the finding.

An incident marked handled is open to no rule, by the rule every count follows
(server/findings/handled.py): the mark forgets what was announced before it, so the
incident's signal returning after the mark announces it again, as "reopened".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from ampwatch.server.alerts.settings import AlertRule
from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.findings.bisect_verdicts import with_verdicts
from ampwatch.server.findings.handled import apply_marks, handled_marks
from ampwatch.server.findings.incidents import Incident, group_incidents, needs_layer_order
from ampwatch.server.findings.queries import bisected_bundles, layer_orders
from ampwatch.server.models import AlertNotification, Finding, as_utc

OPEN = "open"
State = tuple[str, str]  # (status, severity)
# the columns incident grouping and the payload need
FINDING_COLUMNS = (Finding.id, Finding.run_id, Finding.rank, Finding.kind, Finding.code,
                   Finding.severity, Finding.status, Finding.step, Finding.last_step,
                   Finding.layer, Finding.message, Finding.count, Finding.evidence,
                   Finding.created_at, Finding.updated_at)


def run_incidents(connection: Connection, run_id: str, ranks: Iterable[int]
                  ) -> tuple[list[Incident], dict[int, Mapping[str, Any]], dict[int, datetime]]:
    """The run's incidents on `ranks` as stored now (inside the flush that changed them),
    those marked handled and quiet since with status "handled" (as the API tells them,
    fixes included); its findings by id; and its handled marks (incident id -> when).
    Three queries (four with findings that need the layer order to join an overflow:
    `needs_layer_order`); the cost grows with the run's findings, and it is paid only by a
    flush that changed a finding's status or severity, or moved a finding of a run with a
    handled mark."""
    rows = connection.execute(
        select(*FINDING_COLUMNS).where(Finding.run_id == run_id,
                                       Finding.rank.in_(sorted(set(ranks))))
    ).mappings().all()
    order = layer_orders(connection, [run_id]).get(run_id) if needs_layer_order(rows) else None
    incidents = with_verdicts(group_incidents(rows, order),
                              bisected_bundles(connection, [run_id]).get(run_id, ()))
    marks = handled_marks(connection, [run_id]).get(run_id, {})
    if marks:
        incidents = apply_marks(incidents, marks,
                                {row["id"]: as_utc(row["updated_at"]) for row in rows})
    return incidents, {row["id"]: row for row in rows}, marks


def incident_state(members: list[Mapping[str, Any]],
                   before: Mapping[int, State | None]) -> tuple[State | None, State]:
    """(state before this flush or None when none of `members` existed, state now) of the
    findings `members`, given the changed findings' states before the flush (None: new).

    A finding that began and ended inside this flush (a 30-step skip streak within one
    batch) counts as open for the severity now: it happened, and was never announced."""
    now = [(m["status"], m["severity"]) for m in members]
    earlier = [before[m["id"]] if m["id"] in before else (m["status"], m["severity"])
               for m in members]
    earlier = [s for s in earlier if s is not None]
    passing = [m["severity"] for m in members
               if m["id"] in before and before[m["id"]] is None and m["status"] != OPEN]
    status, severity = _combine(now)
    if passing and status == OPEN:
        severity = max([severity, *passing], key=SEVERITY_RANK.__getitem__)
    return (_combine(earlier) if earlier else None), (status, severity)


def _combine(states: list[State]) -> State:
    live = [severity for status, severity in states if status == OPEN]
    pool = live or [severity for _, severity in states]
    return (OPEN if live else "resolved"), max(pool, key=SEVERITY_RANK.__getitem__)


def rule_members(rule: AlertRule, incident: Incident,
                 findings: Mapping[int, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The incident's findings that `rule` looks at (its kinds; all without kinds)."""
    members = [findings[i] for i in incident.findings]
    return [m for m in members if not rule.kinds or m["kind"] in rule.kinds]


def announced_severities(connection: Connection, subject_id: int, run_id: str,
                         created_at: str | None, subject: str = "incident",
                         since: datetime | None = None) -> dict[str, str]:
    """Per rule, the highest severity the incident (or, with subject "finding", the
    finding) `subject_id` was announced at since its last announced resolution and after
    `since` (when it was marked handled), read back from the outbox; `created_at`, its
    (first) finding's, tells a reused id apart (SQLite reuses the largest id after a
    delete)."""
    rows = connection.execute(
        select(AlertNotification.rule, AlertNotification.event, AlertNotification.severity,
               AlertNotification.payload, AlertNotification.created_at)
        .where(AlertNotification.finding_id == subject_id,
               AlertNotification.run_id == run_id)
        .order_by(AlertNotification.id)
    ).all()
    found: dict[str, str] = {}
    for rule, what, severity, payload, written in rows:
        if (payload or {}).get(subject, {}).get("created_at") != created_at:
            continue
        if since is not None and as_utc(written) <= since:
            continue
        if what == "resolved":
            found.pop(rule, None)
        elif SEVERITY_RANK.get(severity, 0) >= SEVERITY_RANK.get(found.get(rule), -1):
            found[rule] = severity
    return found


def incident_json(incident: Incident, state: State, created_at: str | None, run_url: str,
                  first_message: str) -> dict[str, Any]:
    """The `incident` object of a webhook payload (docs/alerts.md). An incident with no
    known cause is one finding: its message, `first_message`, is the headline."""
    status, severity = state
    return {
        "id": incident.id, "cause": incident.cause, "layer": incident.layer,
        "severity": severity, "status": status, "rank": incident.rank,
        "step": incident.step, "last_step": incident.last_step,
        "headline": incident.headline or first_message, "fix": incident.fix,
        "findings": incident.findings,
        "timeline": [{"step": e.step, "what": e.what, "finding": e.finding,
                      "severity": e.severity} for e in incident.timeline],
        "url": incident_url(run_url, incident.step), "created_at": created_at,
    }


STEP_CONTEXT = 100  # steps shown before an incident's first step on its run page link


def incident_url(run_url: str, step: int | None) -> str:
    """The run page, opened on the steps around the incident's first step."""
    if step is None:
        return run_url
    return f"{run_url}?start={max(step - STEP_CONTEXT, 0)}&end={step + STEP_CONTEXT}"
