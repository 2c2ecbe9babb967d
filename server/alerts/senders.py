"""Sending one notification to one target: a JSON webhook POST (httpx), or any apprise
URL. Errors come back as `SendResult`s whose text never holds the target's secrets."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

from ampwatch.server import __version__
from ampwatch.server.alerts.settings import AlertTarget, redact_url

ERROR_CHARS = 500


@dataclass(frozen=True)
class SendResult:
    ok: bool
    status_code: int | None = None
    error: str | None = None


def send(target: AlertTarget, payload: dict[str, Any], http: httpx.Client) -> SendResult:
    """Deliver `payload` to `target`; blocks up to the client's timeout (webhook) or
    apprise's own (apprise). Never raises for a failed delivery."""
    url = target.url.get_secret_value()
    try:
        if target.type == "webhook":
            return _webhook(url, payload, http)
        return _apprise(url, payload)
    except Exception as exc:  # a target's failure must not stop the dispatcher
        return SendResult(False, error=scrub(f"{type(exc).__name__}: {exc}", url))


def _webhook(url: str, payload: dict[str, Any], http: httpx.Client) -> SendResult:
    headers = {"User-Agent": f"ampwatch/{__version__}",
               "Idempotency-Key": f"ampwatch-{payload.get('notification_id')}"}
    try:
        response = http.post(url, json=payload, headers=headers)
    except httpx.HTTPError as exc:
        return SendResult(False, error=scrub(f"{type(exc).__name__}: {exc}", url))
    if response.is_success:
        return SendResult(True, response.status_code)
    return SendResult(False, response.status_code,
                      scrub(f"HTTP {response.status_code}: {response.text[:200]}", url))


APPRISE_TYPES = {"critical": "failure", "warning": "warning", "info": "info"}


def _apprise(url: str, payload: dict[str, Any]) -> SendResult:
    with warnings.catch_warnings():
        # apprise imports imghdr on first use: its DeprecationWarning is apprise's matter
        warnings.simplefilter("ignore", DeprecationWarning)
        return _notify_apprise(url, payload)


def _notify_apprise(url: str, payload: dict[str, Any]) -> SendResult:
    import apprise

    notifier = apprise.Apprise()
    if not notifier.add(url):
        return SendResult(False, error="apprise does not understand this target's URL")
    judged = payload.get("incident") or payload.get("finding", {})
    kind = "success" if payload.get("event") == "resolved" else \
        APPRISE_TYPES.get(judged.get("severity"), "info")
    # apprise's messages may quote the target URL: keep them out of the server's log
    # (only the dispatcher thread sends through apprise) and record them scrubbed
    apprise_log = logging.getLogger("apprise")
    propagate, apprise_log.propagate = apprise_log.propagate, False
    try:
        with apprise.LogCapture(level=logging.WARNING) as captured:
            ok = notifier.notify(title=payload["title"], body=notification_body(payload),
                                 notify_type=kind)
            text = captured.getvalue().strip()
    finally:
        apprise_log.propagate = propagate
    if ok:
        return SendResult(True)
    return SendResult(False, error=scrub(text or "apprise reported a failed delivery", url))


def notification_body(payload: dict[str, Any]) -> str:
    """The plain-text body of a chat or mail notification."""
    finding, run = payload.get("finding", {}), payload.get("run", {})
    incident = payload.get("incident")
    if incident is not None:
        return "\n".join(line for line in incident_lines(incident) if line)
    lines = [finding.get("message", "")]
    if finding.get("last_step") is not None and finding.get("step") is not None:
        lines.append(f"steps {finding['step']}..{finding['last_step']}, "
                     f"seen {finding.get('count', 1)} times, rank {finding.get('rank', 0)}")
    lines.append(run.get("url", ""))
    return "\n".join(line for line in lines if line)


def scrub(text: str, url: str) -> str:
    """`text` (an error message) with every part of `url` that can be a secret replaced
    by "***": credentials, path segments, query values, and for non-web URLs the host;
    the whole URL by its redacted form."""
    text = text.replace(url, redact_url(url))
    parts = urlsplit(url)
    secrets = {parts.password or "", parts.username or "", parts.path, parts.query,
               *parts.path.split("/"), *(v for _, v in parse_qsl(parts.query))}
    if parts.scheme.lower() not in ("http", "https"):
        secrets |= {parts.netloc, parts.hostname or ""}
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text[:ERROR_CHARS]


def incident_lines(incident: dict[str, Any]) -> list[str]:
    """What an incident's notification says: what happened, its cause and layer, the first
    step, the fix and the link to the run page around that step."""
    cause = (incident.get("cause") or "").replace("_", " ")
    where = [f"cause: {cause}" if cause else "",
             f"layer: {incident['layer']}" if incident.get("layer") else "",
             f"first step: {incident['step']}" if incident.get("step") is not None else "",
             f"rank {incident.get('rank', 0)}"]
    return [incident.get("headline") or "", ", ".join(w for w in where if w),
            f"Fix: {incident['fix']}" if incident.get("fix") else "", incident.get("url", "")]
