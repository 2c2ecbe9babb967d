"""`AlertService`: the alert parts of one app, wired to its sessionmaker."""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker

from ampwatch.server.alerts.dispatcher import Dispatcher
from ampwatch.server.alerts.outbox import AlertOutbox
from ampwatch.server.alerts.settings import AlertSettings


class AlertService:
    """With rules, every finding change is checked against them in its own transaction;
    with targets, a dispatcher thread (started and stopped with the app) sends the
    outbox. Without either it does nothing and costs nothing."""

    def __init__(self, maker: sessionmaker, settings: AlertSettings, public_url: str) -> None:
        self.settings = settings
        self.dispatcher = Dispatcher(maker, settings) if settings.targets else None
        self.outbox = AlertOutbox(settings, public_url,
                                  on_commit=self.dispatcher.wake if self.dispatcher else None)
        if settings.rules:
            self.outbox.install(maker)

    def start(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.start()

    def stop(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.stop()
