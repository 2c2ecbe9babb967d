"""Incidents marked handled: the one rule for what is open.

An open incident that a person marked handled (a `handled` note on it, server/services/
notes.py) is no longer open anywhere: not in the run's status and counts, the runs list,
compare, the API, `/metrics` or the page's order (it stays, struck through, below the open
ones). It opens again when its signal returns after the mark: one of its findings changed
(a new occurrence, a later step, a higher severity) after the note was written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.models import RunNote, as_utc

if TYPE_CHECKING:  # findings.store imports this module, and incidents imports the detectors
    from ampwatch.server.findings.incidents import Incident

HANDLED = "handled"
STATUS_ORDER = {"open": 0, HANDLED: 1, "resolved": 2}


def handled_marks(session: Session | Connection,
                  run_ids: Iterable[str]) -> dict[str, dict[int, datetime]]:
    """Per run, incident id -> when it was last marked handled. One grouped query."""
    run_ids = list(run_ids)
    if not run_ids:
        return {}
    marks: dict[str, dict[int, datetime]] = {}
    for run_id, incident, at in session.execute(
            select(RunNote.run_id, RunNote.incident, func.max(RunNote.created_at))
            .where(RunNote.run_id.in_(run_ids), RunNote.handled.is_(True),
                   RunNote.incident.is_not(None))
            .group_by(RunNote.run_id, RunNote.incident)):
        marks.setdefault(run_id, {})[incident] = as_utc(at)
    return marks


def has_marks(session: Session | Connection, run_id: str) -> bool:
    """Whether any incident of the run was marked handled (one indexed lookup)."""
    return session.scalar(select(RunNote.id).where(
        RunNote.run_id == run_id, RunNote.handled.is_(True)).limit(1)) is not None


def apply_marks(incidents: list[Incident], marks: Mapping[int, datetime],
                changed_at: Mapping[int, datetime]) -> list[Incident]:
    """`incidents` with each open one marked handled and not changed since (`changed_at`:
    finding id -> its last update) set to status "handled"; ordered open, handled, then
    resolved, keeping each group's order. A mark names the incident by its earliest
    finding's id, so it is matched against every finding of the incident."""
    for incident in incidents:
        at = marked_at(incident, marks)
        if incident.status == "open" and at is not None and \
                all(changed_at[f] <= at for f in incident.findings if f in changed_at):
            incident.status = HANDLED
    return sorted(incidents, key=lambda i: STATUS_ORDER[i.status])


def marked_at(incident: Incident, marks: Mapping[int, datetime]) -> datetime | None:
    """When `incident` was last marked handled (None: never, or the mark was removed)."""
    return max((marks[f] for f in incident.findings if f in marks), default=None)


def open_severities(incidents: Iterable[Incident],
                    severity_of: Mapping[int, str]) -> list[str]:
    """The severities of the open findings (`severity_of`: open finding id -> severity)
    that belong to incidents still open (not handled)."""
    return [severity_of[f] for i in incidents if i.status == "open"
            for f in i.findings if f in severity_of]


def worst_status(severities: Iterable[str]) -> str:
    """A run's status from its open findings' severities: info counts as healthy."""
    worst = max(severities, key=SEVERITY_RANK.__getitem__, default="info")
    return worst if SEVERITY_RANK[worst] > SEVERITY_RANK["info"] else "healthy"
