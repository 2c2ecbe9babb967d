"""The alerts part of `ampwatch demo`: a webhook receiver on 127.0.0.1 in the demo's own
process, the server settings that send warnings and criticals to it, and the lines that
say what the server notified. Standard library only (agent/ never imports server/)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ampwatch.client.api import Client

SETTLE_TIMEOUT_S = 15.0
RULE = "demo-warnings"


class DemoWebhook:
    """A JSON webhook on a free port of 127.0.0.1 that keeps what it receives."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    received.append(json.loads(body))
                    status = 200
                except ValueError:
                    status = 400
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass  # the demo prints its own summary

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/ampwatch-demo"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ampwatch-demo-webhook", daemon=True)

    def start(self) -> DemoWebhook:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def server_env(self) -> dict[str, str]:
        """Environment for `ampwatch serve`: one rule, warnings and up, to this webhook."""
        return {
            "AMPWATCH_ALERTS__TARGETS": json.dumps({"demo-webhook": {"url": self.url}}),
            "AMPWATCH_ALERTS__RULES": json.dumps([{"name": RULE, "severity": "warning",
                                                   "targets": ["demo-webhook"]}]),
        }


def settle(client: Client, timeout: float = SETTLE_TIMEOUT_S) -> None:
    """Wait (up to `timeout`) until the server's outbox has nothing pending."""
    deadline = time.monotonic() + timeout
    while client.deliveries(status="pending", limit=1) and time.monotonic() < deadline:
        time.sleep(0.2)


def summary(webhook: DemoWebhook) -> str:
    """What the webhook received, one line per notification."""
    if not webhook.received:
        return f"\nAlerts: the webhook at {webhook.url} received nothing."
    lines = [f"\nAlerts: the server notified the webhook at {webhook.url} "
             f"(rule {RULE!r}: warnings and up) {len(webhook.received)} times:"]
    for note in sorted(webhook.received, key=lambda n: n.get("notification_id", 0)):
        lines.append(f"  {note['event']:<9} {note['title']}")
    lines.append("Slack, Teams, Discord, mail or ntfy instead: see docs/alerts.md.")
    return "\n".join(lines)
