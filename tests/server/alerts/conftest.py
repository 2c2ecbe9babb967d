"""Alert test fixtures: a real receiver, and the real app with rules that send to it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.alerts.receiver import Receiver

FAST_RETRIES = {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "poll_interval_s": 0.1,
                "timeout_s": 5.0}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.stop()


def alert_config(url: str, **rule) -> dict:
    return {"targets": {"hook": {"url": url}},
            "rules": [{"name": "page-me", "severity": "warning", "targets": ["hook"], **rule}],
            "public_url": "https://ampwatch.example.com", **FAST_RETRIES}


@pytest.fixture
def alert_app(database_url, receiver, request):
    """The app with one rule (warning and up, to the receiver); a test's
    `@pytest.mark.parametrize("rule", [{...}])` adds to the rule."""
    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    rule = getattr(request, "param", {})
    app = create_app(Settings(database_url=database_url,
                              alerts=alert_config(receiver.url, **rule)))
    yield app
    close_app(app)


@pytest.fixture
def alert_api(alert_app):
    from tests.conftest import judged_client

    with judged_client(alert_app, raise_server_exceptions=True) as client:
        yield client
