"""Which of a run's incidents changed since the last look: opened, escalated, resolved,
handled (a person marked it so on the server) or reopened. Reads the server's incidents
API through the agent's own HTTP sender; may block up to `TIMEOUT_S` per request, so it
runs on the mirror's thread only."""

from __future__ import annotations

from typing import Any

from ampwatch.agent.transport.sender import Outcome, Sender
from ampwatch.trackers.incident_notes import IncidentNote, bundle_for, first_change

SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


class IncidentWatch:
    """Polls one run's incidents (all ranks) and turns changes into notes."""

    TIMEOUT_S = 5.0

    def __init__(self, sender: Sender, server: str, run_id: str) -> None:
        self.sender, self.server, self.run_id = sender, server, run_id
        self._seen: dict[int, tuple[str, str]] = {}  # id -> (status, severity) told

    def poll(self, wait: float = 0.0) -> list[IncidentNote]:
        """The changes since the previous poll; [] when the server did not answer.
        `wait`: seconds the server may first wait for the analysis of the run's stored
        batches (the last look at detach: the final batches are judged, not still queued)."""
        query = f"?wait={wait:.3g}" if wait > 0 else ""
        reply = self.sender.get_json(f"/api/v1/runs/{self.run_id}/incidents{query}",
                                     self.TIMEOUT_S + wait)
        if reply.outcome is not Outcome.OK or not isinstance(reply.body, dict):
            return []
        changed = []
        for incident in reply.body.get("items", []):
            change = self._change(incident)
            if change is not None:
                changed.append((incident, change))
        if not changed:
            return []
        bundles = self._list("bundles")
        messages = {} if all(i.get("headline") for i, _ in changed) else {
            f["id"]: f.get("message") for f in self._list("findings?limit=500")}
        notes = []
        for incident, change in sorted(changed, key=lambda pair: pair[0]["id"]):
            self._seen[incident["id"]] = (incident["status"], incident["severity"])
            first = (incident.get("findings") or [None])[0]
            notes.append(IncidentNote.from_incident(
                incident, change, f"{self.server}/runs/{self.run_id}",
                bundle_for(incident, bundles), messages.get(first)))
        return notes

    def _change(self, incident: dict[str, Any]) -> str | None:
        before = self._seen.get(incident["id"])
        status, severity = incident["status"], incident["severity"]
        if before is None:
            return first_change(status)
        if before[0] != status:
            return "reopened" if status == "open" else status  # resolved, or handled
        if SEVERITY_ORDER.get(severity, 0) > SEVERITY_ORDER.get(before[1], 0):
            return "escalated"
        return None

    def _list(self, resource: str) -> list[dict[str, Any]]:
        reply = self.sender.get_json(f"/api/v1/runs/{self.run_id}/{resource}", self.TIMEOUT_S)
        if reply.outcome is not Outcome.OK or not isinstance(reply.body, dict):
            return []
        return reply.body.get("items", [])

