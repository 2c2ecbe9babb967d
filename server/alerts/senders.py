"""Sending one notification to one target: a JSON webhook POST (httpx), or any apprise
URL. Errors come back as `SendResult`s whose text never holds the target's secrets."""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, unquote_plus, urlsplit

import httpx

from ampwatch.server import __version__
from ampwatch.server.alerts.markup import discord_payload, discord_webhook, one_line
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
        discord = discord_webhook(url)
        if discord is not None:  # apprise cannot set allowed_mentions
            return _post(discord, discord_payload(payload["title"], notification_text(payload),
                                                  notification_link(payload)), http, url)
        return _apprise(url, payload)
    except Exception as exc:  # a target's failure must not stop the dispatcher
        return SendResult(False, error=scrub(f"{type(exc).__name__}: {exc}", url))


def _webhook(url: str, payload: dict[str, Any], http: httpx.Client) -> SendResult:
    return _post(url, payload, http, url, {
        "Idempotency-Key": f"ampwatch-{payload.get('notification_id')}"})


def _post(url: str, body: dict[str, Any], http: httpx.Client, target_url: str,
          headers: dict[str, str] | None = None) -> SendResult:
    """POST `body` as JSON; errors scrubbed of `target_url`'s secrets."""
    headers = {"User-Agent": f"ampwatch/{__version__}", **(headers or {})}
    try:
        response = http.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return SendResult(False, error=scrub(f"{type(exc).__name__}: {exc}", target_url))
    if response.is_success:
        return SendResult(True, response.status_code)
    return SendResult(False, response.status_code,
                      scrub(f"HTTP {response.status_code}: {response.text[:200]}", target_url))


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
            # plain text: apprise escapes it for the target's own format (Slack: &, <, >
            # as entities, mrkdwn off; mail: no HTML part), so names cannot mention,
            # link or embed anything
            ok = notifier.notify(title=one_line(payload["title"]),
                                 body=notification_body(payload), notify_type=kind,
                                 body_format=apprise.NotifyFormat.TEXT)
            text = captured.getvalue().strip()
    finally:
        apprise_log.propagate = propagate
    if ok:
        return SendResult(True)
    return SendResult(False, error=scrub(text or "apprise reported a failed delivery", url))


def notification_text(payload: dict[str, Any]) -> str:
    """The plain text of a chat or mail notification, without its link."""
    incident = payload.get("incident")
    if incident is not None:
        return "\n".join(line for line in incident_lines(incident) if line)
    finding = payload.get("finding", {})
    lines = [finding.get("message", "")]
    if finding.get("last_step") is not None and finding.get("step") is not None:
        lines.append(f"steps {finding['step']}..{finding['last_step']}, "
                     f"seen {finding.get('count', 1)} times, rank {finding.get('rank', 0)}")
    return "\n".join(line for line in lines if line)


def notification_link(payload: dict[str, Any]) -> str:
    """This server's page for the notification: the incident's, else the run's."""
    return (payload.get("incident") or {}).get("url") or payload.get("run", {}).get("url", "")


def notification_body(payload: dict[str, Any]) -> str:
    """The plain-text body of a chat or mail notification: its text and its link."""
    return "\n".join(part for part in (notification_text(payload), notification_link(payload))
                     if part)


def scrub(text: str, url: str) -> str:
    """`text` (an error message) with every part of `url` that can be a secret replaced
    by "***": credentials, path segments, query values, and for non-web URLs the host;
    the whole URL by its redacted form. Each part in every form a library may echo it:
    as written, percent-decoded, and percent-encoded (either case of hex digits, spaces
    as %20 or +)."""
    text = text.replace(url, redact_url(url))
    parts = urlsplit(url)
    secrets = {parts.password or "", parts.username or "", parts.path, parts.query,
               *parts.path.split("/"), *(v for _, v in parse_qsl(parts.query))}
    if parts.scheme.lower() not in ("http", "https"):
        secrets |= {parts.netloc, parts.hostname or ""}
    forms = {form for secret in secrets for form in secret_forms(secret) if len(form) >= 4}
    if forms:
        pattern = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
        text = re.sub(pattern, "***", text, flags=re.IGNORECASE)
    return text[:ERROR_CHARS]


def secret_forms(secret: str) -> set[str]:
    """`secret` as written, decoded, and encoded the ways URL libraries encode."""
    forms = {secret}
    for plain in {secret, unquote(secret), unquote_plus(secret)}:
        forms |= {plain, quote(plain, safe=""), quote(plain), quote_plus(plain),
                  quote(plain, safe="/:@!$&'()*+,;=")}
    return forms


def incident_lines(incident: dict[str, Any]) -> list[str]:
    """What an incident's notification says: what happened, its cause and layer, the first
    step and the fix (its link: `notification_link`)."""
    cause = (incident.get("cause") or "").replace("_", " ")
    where = [f"cause: {cause}" if cause else "",
             f"layer: {incident['layer']}" if incident.get("layer") else "",
             f"first step: {incident['step']}" if incident.get("step") is not None else "",
             f"rank {incident.get('rank', 0)}"]
    return [incident.get("headline") or "", ", ".join(w for w in where if w),
            f"Fix: {incident['fix']}" if incident.get("fix") else ""]
