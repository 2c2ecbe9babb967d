"""The outbox across processes: a server restart between the finding and its delivery,
two dispatchers sharing one database, apprise targets, the CLI, and secrets that never
show in the API or the logs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
from sqlalchemy import select

from ampwatch.server.alerts.dispatcher import Dispatcher
from ampwatch.server.alerts.outbox import AlertOutbox
from ampwatch.server.alerts.settings import AlertSettings
from ampwatch.server.db import make_engine, session_info, upgrade
from ampwatch.server.faults import DatabaseHealth
from ampwatch.server.models import AlertAttempt
from ampwatch.wire import encode_tree
from tests.conftest import LiveServer
from tests.server.alerts.conftest import FAST_RETRIES, alert_config
from tests.server.alerts.receiver import Receiver, wait_until
from tests.server.analysis.factories import scaler_steps
from tests.utils import WAIT, make_layers

SECRET = "s3cret-token"
ENV = {"autocast_dtype": "float16", "scaler": {"growth_interval": 2000, "enabled": True}}


def alerts_file(tmp_path, url: str) -> dict[str, str]:
    """Server environment with one rule to `url` from a TOML file, and fast retries."""
    path = tmp_path / "alerts.toml"
    path.write_text(f'[targets.hook]\nurl = "{url}"\n\n'
                    '[[rules]]\nname = "page-me"\nseverity = "warning"\ntargets = ["hook"]\n')
    env = {"AMPWATCH_ALERTS__FILE": str(path)}
    env |= {f"AMPWATCH_ALERTS__{k.upper()}": str(v) for k, v in FAST_RETRIES.items()}
    return env


def diverge(url: str, run_id: str = "r1") -> None:
    with httpx.Client(base_url=f"{url}/api/v1", timeout=60) as http:
        http.put(f"/runs/{run_id}", json={"name": run_id, "project": "llm",
                                          "layers": make_layers(4),
                                          "environment": ENV}).raise_for_status()
        steps = scaler_steps(230, overflow=range(200, 230), init_scale=2.0**40)
        http.post(f"/runs/{run_id}/batches",
                  json={"rank": 0, "seq": 0, "steps": encode_tree(steps)}).raise_for_status()
        # judged, and its notifications queued, once the run has nothing pending
        assert http.get(f"/runs/{run_id}", params=WAIT).json()["analysis_pending"] == 0


def deliveries(url: str) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/alerts/deliveries", timeout=10)
    reply.raise_for_status()
    return reply.json()["items"]


def test_a_restart_between_finding_and_delivery_loses_and_repeats_nothing(tmp_path):
    receiver = Receiver()  # not started: the target is down while the first server runs
    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log",
                        env=alerts_file(tmp_path, receiver.url))
    server.start()
    try:
        diverge(server.url)
        wait_until(lambda: all(d["attempts"] >= 1 for d in deliveries(server.url)), 20,
                   lambda: str(deliveries(server.url)))
        queued = deliveries(server.url)
        assert queued and all(d["status"] == "pending" for d in queued)
        server.stop()

        receiver.start()
        server.start()  # a new process on the same database
        receiver.wait_for(len(queued))
        wait_until(lambda: all(d["status"] == "delivered" for d in deliveries(server.url)),
                   20, lambda: str(deliveries(server.url)))
        assert len(receiver.accepted) == len(queued)
        assert sorted(n["notification_id"] for n in receiver.accepted) == \
            sorted(d["id"] for d in queued)

        # secrets in the target URL never show: API, deliveries, log
        shown = httpx.get(f"{server.url}/api/v1/alerts", timeout=10).json()
        assert shown["targets"] == [{"name": "hook", "type": "webhook",
                                     "url": f"http://127.0.0.1:{receiver.port}/..."}]
        assert shown["rules"][0]["name"] == "page-me"
        assert SECRET not in json.dumps(shown) + json.dumps(deliveries(server.url))
        failures = [a for d in deliveries(server.url) for a in d["history"] if not a["ok"]]
        assert failures and all(a["error"] for a in failures)
    finally:
        server.stop()
        receiver.stop()
    log = server.log_path.read_text()
    assert "failed (attempt 1" in log and SECRET not in log
    assert f"alerts: 1 rules; targets hook http://127.0.0.1:{receiver.port}/..." in log


@pytest.fixture
def outbox_database(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    yield database_url
    engine.dispose()


def test_two_dispatchers_on_one_database_send_each_notification_once(outbox_database,
                                                                      receiver):
    """Two replicas (separate engines, as separate processes have) race over one outbox."""
    from sqlalchemy.orm import sessionmaker

    settings = AlertSettings(**alert_config(receiver.url))
    makers = []
    for _ in range(2):
        engine = make_engine(outbox_database)
        makers.append(sessionmaker(engine, expire_on_commit=False,
                                   info=session_info(engine, DatabaseHealth())))
    outbox = AlertOutbox(settings, "http://ampwatch")
    with makers[0]() as session:
        ids = outbox.enqueue_test(session, ["hook"] * 40)
        session.commit()
    dispatchers = [Dispatcher(maker, settings) for maker in makers]
    errors = []

    def drain(dispatcher: Dispatcher) -> None:
        try:
            while dispatcher.send_one():
                pass
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(d,)) for d in dispatchers * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    sent = sorted(n["notification_id"] for n in receiver.accepted)
    assert sent == sorted(ids)
    with makers[0]() as session:
        attempts = session.scalars(select(AlertAttempt.notification_id)).all()
    assert sorted(attempts) == sorted(ids)
    for dispatcher in dispatchers:
        dispatcher.stop()
    for maker in makers:
        maker.kw["bind"].dispose()


def test_apprise_targets_send_through_apprise(outbox_database, receiver, caplog):
    """apprise's json:// service posts to the receiver: the apprise path, for real."""
    from sqlalchemy.orm import sessionmaker

    url = f"json://127.0.0.1:{receiver.port}/hook?+X-Token={SECRET}"
    settings = AlertSettings(**{**alert_config(url)})
    assert settings.targets["hook"].type == "apprise"
    engine = make_engine(outbox_database)
    maker = sessionmaker(engine, expire_on_commit=False,
                         info=session_info(engine, DatabaseHealth()))
    with maker() as session:
        AlertOutbox(settings, "http://ampwatch").enqueue_test(session, ["hook"])
        session.commit()
    dispatcher = Dispatcher(maker, settings)
    assert dispatcher.send_one()
    [got] = receiver.accepted
    assert got["title"] == "ampwatch: test notification"
    assert "reachable" in got["message"]
    assert {k.lower(): v for k, v in receiver.headers[0].items()}["x-token"] == SECRET
    receiver.stop()  # now down: a failed attempt, recorded without the secret
    with maker() as session:
        AlertOutbox(settings, "http://ampwatch").enqueue_test(session, ["hook"])
        session.commit()
    assert dispatcher.send_one()
    with maker() as session:
        last = session.scalars(select(AlertAttempt).order_by(AlertAttempt.id.desc())).first()
    assert not last.ok and last.error and SECRET not in last.error
    assert "failed (attempt 1" in caplog.text and SECRET not in caplog.text
    dispatcher.stop()
    engine.dispose()


def test_cli_lists_the_rules_and_sends_a_test(tmp_path, receiver):
    server = LiveServer(f"sqlite:///{tmp_path / 'live.db'}", tmp_path / "server.log",
                        env=alerts_file(tmp_path, receiver.url))
    server.start()
    try:
        cli = [sys.executable, "-m", "ampwatch.client.cli"]
        shown = subprocess.run([*cli, "alerts", "--server", server.url], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "page-me" in shown.stdout and f"127.0.0.1:{receiver.port}/..." in shown.stdout
        assert SECRET not in shown.stdout
        sent = subprocess.run([*cli, "alerts", "test", "--server", server.url],
                              capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        assert "delivered" in sent.stdout
        assert [n["event"] for n in receiver.accepted] == ["test"]

        receiver.stop()
        failed = subprocess.run([*cli, "alerts", "test", "--server", server.url, "--wait",
                                 "1", "--json"], capture_output=True, text=True, timeout=60)
        assert failed.returncode == 1
        [pending] = json.loads(failed.stdout)
        assert pending["status"] == "pending" and pending["history"][0]["ok"] is False
    finally:
        server.stop()
