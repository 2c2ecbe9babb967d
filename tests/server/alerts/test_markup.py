"""Client text in notifications says only what it says: run and layer names that carry
Slack, Discord or HTML markup reach each target escaped, Discord pings no one, and a
target's secrets are scrubbed from errors in every encoded form. Slack, Discord and a mail
server cannot be started here: the requests that would reach them are recorded at the
network boundary (requests' adapter, httpx's transport, smtplib), after all of our code
and apprise's ran."""

from __future__ import annotations

import json
import smtplib
from email import message_from_string
from email.message import Message

import httpx
import pytest
import requests

from ampwatch.server.alerts.outbox import notification_payload
from ampwatch.server.alerts.senders import scrub, send
from ampwatch.server.alerts.settings import AlertTarget

pytest.importorskip("apprise")

EVIL = ("<!everyone> <https://evil.example|login> <@U123ABC> @here "
        "[click](https://evil.example) <a href=\"https://evil.example\">a</a> "
        "<img src=\"https://evil.example/i.png\"> *bold*")
SLACK_MARKUP = ("<!everyone>", "<https://evil.example|login>", "<@U123ABC>", "<a href",
                "<img src")


def evil_payload() -> dict:
    finding = {"kind": "nonfinite", "severity": "critical", "status": "open", "rank": 0,
               "step": 166, "last_step": 170, "layer": f"blocks.0 {EVIL}", "count": 3,
               "message": f"layer blocks.0 {EVIL} overflowed fp16", "evidence": {}}
    run = {"id": "r1", "name": f"run {EVIL}", "project": "llm"}
    return {**notification_payload("opened", "page-me", finding, run,
                                   "https://ampwatch.example.com"), "notification_id": 7}


class _Ok(requests.Response):
    def __init__(self, request: requests.PreparedRequest) -> None:
        super().__init__()
        self.status_code, self._content, self.request = 200, b"ok", request


@pytest.fixture
def requests_sent(monkeypatch) -> list[requests.PreparedRequest]:
    """What apprise's plugins send through `requests`, answered 200 "ok"."""
    sent: list[requests.PreparedRequest] = []

    def record(adapter, request, *args, **kwargs):
        sent.append(request)
        return _Ok(request)

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", record)
    return sent


def test_slack_gets_plain_text_with_names_escaped(requests_sent):
    target = AlertTarget(url="slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/#alerts")
    with httpx.Client() as http:
        assert send(target, evil_payload(), http).ok
    body = json.loads(requests_sent[-1].body)
    text = json.dumps(body)
    for markup in SLACK_MARKUP:
        assert markup not in text, markup
    assert "&lt;!everyone&gt;" in text and body.get("mrkdwn") is False
    assert "https://ampwatch.example.com/runs/r1" in text  # our own link stays


def test_discord_gets_escaped_text_and_pings_no_one():
    sent: list[httpx.Request] = []

    def discord(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(204)

    target = AlertTarget(url="discord://4174216298/JHMHI8qBe7bk2ZwO5U711o3dV_js")
    with httpx.Client(transport=httpx.MockTransport(discord)) as http:
        assert send(target, evil_payload(), http).ok
    request = sent[-1]
    assert request.url == "https://discord.com/api/webhooks/4174216298/JHMHI8qBe7bk2ZwO5U711o3dV_js"
    body = json.loads(request.content)
    assert body["allowed_mentions"] == {"parse": []}
    content = body["content"]
    for markup in ("<@U123ABC>", "[click](https", "<https://evil"):
        assert markup not in content, markup
    assert "\\<\\@U123ABC\\>" in content and "\\@here" in content
    assert content.endswith("\nhttps://ampwatch.example.com/runs/r1") and len(content) <= 2000


class _Mailbox:
    """smtplib.SMTP as far as apprise uses it, keeping each message."""

    messages: list[Message] = []

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: (250, b"ok")

    def sendmail(self, sender, recipients, message, *args, **kwargs):
        _Mailbox.messages.append(message_from_string(message))
        return {}


def test_mail_is_plain_text(monkeypatch):
    monkeypatch.setattr(smtplib, "SMTP", _Mailbox)
    _Mailbox.messages = []
    target = AlertTarget(url="mailto://user:pw@127.0.0.1:2525?to=ops@example.com"
                         "&from=ampwatch@example.com&smtp=127.0.0.1")
    with httpx.Client() as http:
        result = send(target, evil_payload(), http)
    assert result.ok, result.error
    message = _Mailbox.messages[-1]
    assert "\n" not in message["Subject"].replace("\n ", "")  # one header line
    parts = {part.get_content_type(): part.get_payload(decode=True).decode()
             for part in message.walk() if not part.is_multipart()}
    assert "text/html" not in parts  # plain text: nothing in it is markup
    assert EVIL in parts["text/plain"]  # the names, as they were sent to us


def test_a_title_is_one_line(requests_sent):
    payload = evil_payload()
    payload["title"] = "ampwatch opened: layer\r\nBcc: all@example.com"
    target = AlertTarget(url="slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/#alerts")
    with httpx.Client() as http:
        assert send(target, payload, http).ok
    title = json.loads(requests_sent[-1].body)["attachments"][0]["title"]
    assert "\r" not in title and "\n" not in title


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/hook?key=SECRET 456&k2=SËCRET",
    "http://127.0.0.1:9/hook?key=SECRET%20456&k2=S%C3%8BCRET",
])
def test_secrets_are_scrubbed_raw_encoded_and_decoded(url):
    """The error texts come from httpx and apprise as they quote URLs: percent-encoded
    (upper- or lowercase hex, space as %20 or +) or decoded."""
    echoed = [str(httpx.URL(url)), str(httpx.URL(url)).lower(), url,
              httpx.URL(url).params["key"], httpx.URL(url).params["k2"],
              "SECRET+456", "SECRET%20456", "S%C3%8BCRET", "s%c3%8bcret", "SËCRET"]
    text = scrub("HTTP 500: " + " | ".join(echoed), url)
    for secret in ("SECRET", "secret", "456", "C3%8B", "c3%8b", "ËCRET"):
        assert secret not in text, (secret, text)
    assert "127.0.0.1" in text
