"""Turning detections into `Finding` rows, and a run's health into `Run.status`.

Matching: a draft updates the latest finding with its key (within the run and rank) when
that finding is open, or when the draft's episode starts within `merge_gap_steps` of the
finding's last step (a condition that comes back soon reopens its finding instead of
adding one). Otherwise it inserts a finding: open when active, resolved when the
episode has already ended. Open findings under a detection's `covers` that got no draft
are resolved.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Select, bindparam, or_, select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.findings.handled import has_marks, worst_status
from ampwatch.server.findings.queries import open_severities_by_run
from ampwatch.server.models import Finding, Run, utcnow

OPEN, RESOLVED = "open", "resolved"


@functools.cache
def _matchable(bounded: bool) -> Select:
    """The select behind `_load` (bind parameters run_id, rank, since), built once: on
    ingest, building it cost as much as running it."""
    recent = Finding.status == OPEN
    if bounded:
        recent = or_(recent, Finding.last_step >= bindparam("since"))
    return (select(Finding)
            .where(Finding.run_id == bindparam("run_id"), Finding.rank == bindparam("rank"),
                   recent)
            .order_by(Finding.id))


def _load(session: Session, run_id: str, rank: int, since: int | None) -> dict[str, Finding]:
    """The latest finding per key that a draft could still match."""
    params = {"run_id": run_id, "rank": rank}
    if since is not None:
        params["since"] = since
    return {f.key: f for f in session.scalars(_matchable(since is not None), params)}


def _same_episode(finding: Finding, draft: FindingDraft, gap: int) -> bool:
    if finding.status == OPEN:
        return True
    if draft.step is None or finding.last_step is None:
        return False
    return draft.step <= finding.last_step + gap


def _set(finding: Finding, name: str, value) -> bool:
    if getattr(finding, name) == value:
        return False
    setattr(finding, name, value)
    return True


def _update(finding: Finding, draft: FindingDraft, current: bool, now: datetime) -> bool:
    """Fold `draft` into `finding`; True when anything changed."""
    changed = False
    previous_last = finding.last_step
    if draft.occurrences.size:
        fresh = (draft.occurrences if previous_last is None
                 else draft.occurrences[draft.occurrences > previous_last])
        if fresh.size:
            changed |= _set(finding, "count", finding.count + int(fresh.size))
    if draft.last_step is not None and (previous_last is None or draft.last_step > previous_last):
        changed |= _set(finding, "last_step", draft.last_step)
    if finding.step is None and draft.step is not None:
        changed |= _set(finding, "step", draft.step)
    if current:
        for name in ("severity", "message", "evidence", "layer", "code"):
            changed |= _set(finding, name, getattr(draft, name))
        changed |= _set(finding, "status", OPEN if draft.active else RESOLVED)
    if changed:
        finding.updated_at = now
    return changed


def _insert(session: Session, run_id: str, rank: int, draft: FindingDraft, current: bool,
            now: datetime) -> Finding:
    finding = Finding(
        run_id=run_id, rank=rank, kind=draft.kind, code=draft.code, key=draft.key,
        severity=draft.severity,
        status=OPEN if draft.active and current else RESOLVED,
        step=draft.step, last_step=draft.last_step, layer=draft.layer, message=draft.message,
        evidence=draft.evidence, count=draft.count, created_at=now, updated_at=now,
    )
    session.add(finding)
    return finding


@dataclass
class HealthChange:
    """How one analysis pass changed the run's open findings."""

    open_delta: int = 0
    severe: bool = False  # a warning/critical finding opened, closed or changed severity

    def note(self, before: tuple[str, str] | None, after: tuple[str, str]) -> None:
        if before == after:
            return
        was_open = before is not None and before[0] == OPEN
        is_open = after[0] == OPEN
        self.open_delta += int(is_open) - int(was_open)
        self.severe |= (was_open and before[1] != "info") or (is_open and after[1] != "info")


def apply_detections(session: Session, run_id: str, rank: int,
                     detections: Iterable[Detection], settings: AnalysisSettings, *,
                     since: int | None = None, current: bool = True) -> HealthChange:
    """Insert, update and resolve the findings of (run, rank); returns how the set of
    open findings changed (for `update_run_health`).

    since: first step of the analysed window (resolved findings ending before it can no
    longer match). current: False for a batch older than the rank's latest step, which
    adds counts and history but changes no open finding's state.
    """
    detections = list(detections)
    existing = _load(session, run_id, rank, None if since is None
                     else since - settings.merge_gap_steps)
    now = utcnow()
    change = HealthChange()
    drafted: set[str] = set()
    for detection in detections:
        for draft in detection.drafts:
            drafted.add(draft.key)
            finding = existing.get(draft.key)
            if finding is not None and _same_episode(finding, draft, settings.merge_gap_steps):
                before = (finding.status, finding.severity)
                _update(finding, draft, current, now)
                change.note(before, (finding.status, finding.severity))
            elif draft.active or draft.occurrences.size:
                finding = existing[draft.key] = _insert(session, run_id, rank, draft, current,
                                                        now)
                change.note(None, (finding.status, finding.severity))
    if current:
        for key, finding in existing.items():
            if finding.status == OPEN and key not in drafted and \
                    any(d.covered(key) for d in detections):
                change.note((OPEN, finding.severity), (RESOLVED, finding.severity))
                finding.status = RESOLVED
                finding.updated_at = now
    return change


def update_run_health(session: Session, run: Run, change: HealthChange) -> None:
    """Apply `change` to the run: a full recount when a warning or critical finding moved
    or the run has incidents marked handled (a finding that changed may reopen one), else
    just the open count (info findings do not change the status)."""
    if change.severe or has_marks(session, run.id):
        refresh_run_health(session, run)
    elif change.open_delta:
        run.open_findings = max((run.open_findings or 0) + change.open_delta, 0)


def refresh_run_health(session: Session, run: Run) -> None:
    """Set `run.status` from its worst open finding (info counts as healthy) and
    `run.open_findings` to their number; findings of incidents marked handled are not
    open (server/findings/handled.py)."""
    severities = open_severities_by_run(session, [run.id])[run.id]
    run.status = worst_status(severities)
    run.open_findings = len(severities)
