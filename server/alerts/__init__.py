"""Alerts on findings: rules and targets (settings), the outbox written with each finding
change (outbox), its dispatcher thread (dispatcher) and the senders (senders).
docs/alerts.md describes the whole."""

from ampwatch.server.alerts.service import AlertService

__all__ = ["AlertService"]
