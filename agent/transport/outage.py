"""When the server cannot be reached or will not store: a malformed URL, an unreachable
server, a refused token, a refused batch, and the recovery, each said once
(agent/notices.py), and the outage told to the server once delivery recovered (a
`delivery` event, shown on the run page and by `ampwatch show`).

Only `say_server_problem` runs on the training thread (at `attach()`, syntax only); the
`OutageWatch` sees the sender thread's responses, so none of this makes training wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ampwatch.agent.notices import tell
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.transport.sender import Outcome, Response
from ampwatch.wire import DELIVERY_EVENT
from ampwatch.wire.spool import run_dir


def spooled_in(settings: AgentSettings) -> Path:
    """The run's folder in the spool: what `ampwatch sync` takes."""
    return run_dir(Path(settings.spool_dir), settings.run_id, settings.rank).parent


def say_server_problem(settings: AgentSettings) -> None:
    """A malformed server URL (no scheme, another scheme, no host, ...; the settings made
    the run spool only): say what is wrong and how to send the run once it is fixed."""
    if settings.server_problem is None:
        return
    folder = spooled_in(settings)
    tell(f"ampwatch: the server URL {settings.server!r} {settings.server_problem}. Nothing "
         f"is sent: the run is spooled in {folder}. Fix AMPWATCH_SERVER (or "
         f"attach(server=...)), then send it with "
         f"`ampwatch sync {folder} --server http://HOST:PORT`")


class OutageWatch:
    """Sender thread: follows the server's responses. The first request of an outage
    that gets no answer, or a 401/403, says so once per condition; once the spool is
    drained after an answer came back, says the recovery once and hands `send_event` a
    `delivery` event (start, end, cause, batches sent since the start)."""

    def __init__(self, settings: AgentSettings, send_event: Callable[[dict[str, Any]], object],
                 delivered_batches: Callable[[], int]) -> None:
        self.settings = settings
        self.send_event = send_event
        self.delivered_batches = delivered_batches  # batches sent so far, in all
        self.cause: str | None = None  # None: no outage
        self._started_at: datetime | None = None
        self._started_mono = 0.0
        self._answered_at: datetime | None = None  # the outage's first answer since
        self._delivered_before = 0
        self._said: set[Outcome] = set()
        self._refusal_said = False  # a refused batch was said (once per run)

    def observe(self, reply: Response) -> None:
        """Every response of the sender: an answer ends the outage's silence; no answer
        (or a refused token) starts or continues one."""
        if reply.outcome is Outcome.UNAUTHORIZED:
            given = "the token was refused" if self.settings.token else "no token was sent"
            self._failed(Outcome.UNAUTHORIZED, f"HTTP {reply.status}: {given}")
        elif reply.error is not None:
            self._failed(Outcome.RETRY, reply.error)
        elif reply.status is not None and self.cause is not None and self._answered_at is None:
            self._answered_at = datetime.now(UTC)

    def _failed(self, condition: Outcome, cause: str) -> None:
        if self.cause is None:
            self._started_at = datetime.now(UTC)
            self._started_mono = time.monotonic()
            self._delivered_before = self.delivered_batches()
        self.cause = cause
        self._answered_at = None
        if condition in self._said:
            return
        self._said.add(condition)
        s, folder = self.settings, spooled_in(self.settings)
        if condition is Outcome.UNAUTHORIZED:
            tell(f"ampwatch: the server {s.server} refused the run ({cause}): set AMPWATCH_TOKEN "
                 f"(or attach(token=...)) to the server's token. Training goes on; the run "
                 f"is spooled in {folder}; send it later with `ampwatch sync {folder} "
                 f"--server {s.server} --token TOKEN`")
        else:
            tell(f"ampwatch: cannot reach the server {s.server} ({cause}). Training goes "
                 f"on; the run is spooled in {folder} and sent when the server answers, or "
                 f"later with `ampwatch sync {folder} --server {s.server}`")

    def refused_batch(self, name: str, reply: Response) -> None:
        """The server refused a batch (a 4xx other than the token's): its steps are not
        stored, and retrying would not change that. Said once per run, with what the
        server said; the batch stays aside in the spool (`rejected/`)."""
        if self._refusal_said:
            return
        self._refusal_said = True
        folder = spooled_in(self.settings)
        tell(f"ampwatch: the server {self.settings.server} refused batch {name} (HTTP "
             f"{reply.status}: {_what_it_said(reply.body)}): its steps are not stored. "
             f"Training goes on; the batch is kept in {folder} (rejected/). Further refused "
             f"batches are not said again")

    def drained(self) -> None:
        """The run's spool is empty: an outage that got answers since is over."""
        if self.cause is None or self._answered_at is None or self._started_at is None:
            return
        sent = self.delivered_batches() - self._delivered_before
        seconds = time.monotonic() - self._started_mono
        # the event first: whoever reads the message may flush and expect it sent
        self.send_event({"step": None, "kind": DELIVERY_EVENT, "detail": {
            "start": self._started_at.isoformat(), "end": self._answered_at.isoformat(),
            "cause": self.cause, "batches_spooled": sent}})
        tell(f"ampwatch: server {self.settings.server} reachable again; {sent} spooled "
             f"batch{'' if sent == 1 else 'es'} sent (delivery was interrupted for "
             f"{seconds:.0f} s: {self.cause})")
        self.cause = self._started_at = self._answered_at = None
        self._said.clear()


def _what_it_said(body: Any) -> str:
    """The server's `detail`, short enough for one line."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    text = detail if isinstance(detail, str) else repr(detail)
    return text if len(text) <= 500 else text[:500] + "..."
