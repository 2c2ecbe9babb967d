"""Alert rules and targets from the environment and a TOML file; redaction of secrets;
which change of a finding is which event."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ampwatch.server.alerts.outbox import _event
from ampwatch.server.alerts.senders import scrub
from ampwatch.server.alerts.settings import AlertRule, AlertSettings, redact_url
from ampwatch.server.settings import Settings

TOML = """
public_url = "https://ampwatch.example.com"

[targets.oncall]
url = "https://hooks.example.com/services/T0/B0/s3cret?key=k3y-value"

[targets.chat]
url = "ntfy://ntfy.example.com/s3cret-topic"

[[rules]]
name = "critical-anywhere"
severity = "critical"
targets = ["oncall", "chat"]
on_resolve = true

[[rules]]
name = "llm-scaler"
projects = ["llm"]
kinds = ["scaler_divergence"]
targets = ["chat"]
"""


def test_rules_and_targets_from_a_toml_file(tmp_path, monkeypatch):
    path = tmp_path / "alerts.toml"
    path.write_text(TOML.replace('public_url = "https://ampwatch.example.com"\n', ""))
    monkeypatch.setenv("AMPWATCH_ALERTS__FILE", str(path))
    monkeypatch.setenv("AMPWATCH_ALERTS__PUBLIC_URL", "https://ampwatch.example.com/")
    settings = Settings()
    alerts = settings.alerts
    assert [r.name for r in alerts.rules] == ["critical-anywhere", "llm-scaler"]
    assert alerts.rules[1].severity == "warning" and alerts.rules[0].on_resolve
    assert {n: t.type for n, t in alerts.targets.items()} == {"oncall": "webhook",
                                                              "chat": "apprise"}
    assert settings.public_url == "https://ampwatch.example.com"


def test_rules_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("AMPWATCH_ALERTS__TARGETS",
                       '{"hook": {"url": "http://127.0.0.1:9/x"}}')
    monkeypatch.setenv("AMPWATCH_ALERTS__RULES",
                       '[{"name": "all", "severity": "info", "targets": ["hook"]}]')
    alerts = Settings().alerts
    assert alerts.enabled and alerts.rules[0].targets == ["hook"]


@pytest.mark.parametrize(("config", "message"), [
    ({"rules": [{"name": "r", "targets": ["nowhere"]}]}, "unknown targets: nowhere"),
    ({"targets": {"a": {"url": "ftp-less"}}}, "has no scheme"),
    ({"targets": {"a": {"url": "slack://x/y/z", "type": "webhook"}}}, "http(s) URL"),
    ({"targets": {"a": {"url": "http://h/"}},
      "rules": [{"name": "r", "targets": ["a"]}, {"name": "r", "targets": ["a"]}]},
     "rule names repeat: r"),
    ({"targets": {"a": {"url": "http://h/"}},
      "rules": [{"name": "r", "severity": "fatal", "targets": ["a"]}]}, "severity"),
])
def test_bad_configuration_is_a_clear_error(config, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AlertSettings(**config)


def test_a_bad_file_names_itself(tmp_path):
    path = tmp_path / "alerts.toml"
    path.write_text("[[rules]\nname=")
    with pytest.raises(ValidationError, match="is not valid TOML"):
        AlertSettings(file=path)
    with pytest.raises(ValidationError, match="cannot read alerts file"):
        AlertSettings(file=tmp_path / "missing.toml")
    path.write_text('[targets.a]\nurl = "http://h/"\n[bogus]\nx = 1\n')
    with pytest.raises(ValidationError, match="bogus"):
        AlertSettings(file=path)


@pytest.mark.parametrize(("url", "shown"), [
    ("https://hooks.slack.com/services/T0/B0/s3cret", "https://hooks.slack.com/..."),
    ("http://user:pa55@127.0.0.1:8080/hook?key=s3cret", "http://127.0.0.1:8080/..."),
    ("https://example.com", "https://example.com/"),
    ("slack://T0k3nA/T0k3nB/T0k3nC/#alerts", "slack://..."),
    ("mailtos://user:pa55@gmail.com", "mailtos://..."),
])
def test_redacted_urls_keep_no_secret(url, shown):
    assert redact_url(url) == shown


def test_error_messages_lose_the_url_secrets():
    url = "http://user:pa55word@127.0.0.1:9/hook/s3cret-path?key=s3cret-key"
    text = scrub(f"ConnectError: cannot reach {url} (s3cret-key, pa55word)", url)
    for secret in ("s3cret", "pa55word"):
        assert secret not in text
    assert "127.0.0.1" in text
    assert "s3cret" not in scrub("failed: slack://s3cret-a/s3cret-b", "slack://s3cret-a/s3cret-b")


RULE = AlertRule(name="r", severity="warning", targets=["t"], on_resolve=True)
QUIET = AlertRule(name="q", severity="warning", targets=["t"])


@pytest.mark.parametrize(("rule", "before", "after", "announced", "event"), [
    (RULE, None, ("open", "warning"), None, "opened"),
    (RULE, None, ("open", "info"), None, None),  # below the rule
    (RULE, None, ("resolved", "critical"), None, "opened"),  # began and ended in a batch
    (RULE, ("open", "info"), ("open", "warning"), None, "opened"),  # crossed the threshold
    (RULE, ("open", "warning"), ("open", "critical"), "warning", "escalated"),
    (RULE, ("open", "critical"), ("open", "warning"), "critical", None),  # calmer: quiet
    (RULE, ("open", "warning"), ("open", "critical"), "critical", None),  # said already
    (RULE, ("open", "critical"), ("resolved", "critical"), "critical", "resolved"),
    (QUIET, ("open", "critical"), ("resolved", "critical"), "critical", None),
    (RULE, ("open", "info"), ("resolved", "info"), None, None),  # never announced
    (RULE, ("resolved", "warning"), ("open", "warning"), None, "opened"),  # reopened
    (QUIET, ("resolved", "warning"), ("open", "warning"), "warning", None),
])
def test_which_change_is_which_event(rule, before, after, announced, event):
    assert _event(rule, before, after, announced) == event
