"""The mirror: ampwatch's per-step signals and incidents, written into the trackers the
user already watches (docs/trackers.md).

The agent's worker hands each decoded step record to `submit()` (a deque append: never
blocks, bounded). The mirror's own thread turns them into scalars once a second, hands each
tracker's lane (lanes.py) a batch, and every `INCIDENTS_EVERY_S` asks the server for the
run's incidents. No tracker credentials go anywhere but the tracker's own library.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ampwatch.agent import errors
from ampwatch.agent.mirror.incidents import IncidentWatch
from ampwatch.agent.mirror.lanes import Lane
from ampwatch.agent.mirror.trackers import tracker_for
from ampwatch.trackers.adapters import Row, Tracker
from ampwatch.trackers.incident_notes import IncidentNote
from ampwatch.trackers.scalars import step_scalars

logger = logging.getLogger("ampwatch.agent.mirror")
ENV = "AMPWATCH_MIRROR"


def resolve_trackers(mirror: Any) -> list[Tracker]:
    """The trackers `mirror` names (one or a list; None: `AMPWATCH_MIRROR`, comma
    separated). A tracker that cannot be had (not installed, no active run) is left out
    and said once; never raises."""
    if mirror is None:
        mirror = [m for m in os.environ.get(ENV, "").split(",") if m.strip()]
    if mirror is False:
        return []
    specs = mirror if isinstance(mirror, list | tuple) else [mirror]
    trackers = []
    for spec in specs:
        try:
            trackers.append(tracker_for(spec))
        except Exception as exc:  # noqa: BLE001 - a missing tracker must not stop attach
            logger.warning("ampwatch: not mirroring into %r (%s: %s); training and ampwatch "
                           "go on without it", spec, type(exc).__name__, exc)
    return trackers


class Mirror:
    """Writes ampwatch's signals and incidents into `trackers`, off the training thread."""

    BATCH_S = 1.0
    INCIDENTS_EVERY_S = 5.0
    MAX_PENDING_STEPS = 16384  # step records waiting for the mirror's thread; more: dropped
    MAX_ANALYSIS_WAIT_S = 10.0  # a sync's incident look waits this long at most for analysis

    def __init__(self, trackers: Sequence[Tracker], watch: IncidentWatch | None) -> None:
        self.lanes = [Lane(t) for t in trackers]
        self.watch = watch
        self.dropped_steps = 0
        self._records: deque[dict[str, Any]] = deque()
        self._stop = threading.Event()
        self._poll_now = threading.Event()
        self._analysis_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ampwatch-mirror", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any]) -> None:
        """Worker thread: a decoded step record (not modified afterwards); never blocks."""
        if len(self._records) >= self.MAX_PENDING_STEPS:
            self.dropped_steps += 1
        else:
            self._records.append(record)

    def sync(self, timeout: float) -> bool:
        """Write every record submitted so far and ask for incidents once, then wait for
        each tracker to take them; blocks up to `timeout`. False when one did not."""
        deadline = time.monotonic() + timeout
        done = threading.Event()
        self._records.append({"_sync": done})
        # the server may first finish judging what was sent: the incidents are then final
        self._analysis_wait_s = min(self.MAX_ANALYSIS_WAIT_S, timeout / 2)
        self._poll_now.set()
        if not done.wait(timeout):
            return False
        return all(lane.wait_idle(max(0.0, deadline - time.monotonic()))
                   for lane in self.lanes)

    def close(self, timeout: float) -> bool:
        """Write what is left, ask for incidents a last time and close every lane within
        `timeout`; True when every tracker took everything."""
        deadline = time.monotonic() + timeout
        synced = self.sync(timeout / 2)
        self._stop.set()
        self._poll_now.set()
        self._thread.join(max(0.05, deadline - time.monotonic()))
        if self.watch is not None and not self._thread.is_alive():
            self.watch.sender.close()
        closed = [lane.close(max(0.05, deadline - time.monotonic())) for lane in self.lanes]
        return synced and all(closed)

    # ------------------------------------------------------------------ mirror thread
    def _run(self) -> None:
        next_poll = time.monotonic() + self.INCIDENTS_EVERY_S
        while not self._stop.is_set():
            polled = self._poll_now.wait(self.BATCH_S)
            self._poll_now.clear()
            if polled or time.monotonic() >= next_poll:
                errors.guarded("mirror.incidents")(self._incidents)()
                next_poll = time.monotonic() + self.INCIDENTS_EVERY_S
            errors.guarded("mirror.steps")(self._steps)()

    def _steps(self) -> None:
        rows: list[Row] = []
        while self._records:
            record = self._records.popleft()
            if "_sync" in record:
                self._hand(rows)
                rows = []
                record["_sync"].set()
                continue
            scalars = step_scalars(record)
            if scalars:
                rows.append((int(record["step"]), scalars))
        self._hand(rows)

    def _hand(self, rows: list[Row]) -> None:
        if rows:
            for lane in self.lanes:
                lane.submit(lambda tracker, rows=rows: tracker.write_scalars(rows))

    def _incidents(self) -> None:
        if self.watch is None:
            return
        wait, self._analysis_wait_s = self._analysis_wait_s, 0.0
        for note in self.watch.poll(wait):
            self.tell(note)

    def tell(self, note: IncidentNote) -> None:
        """Hand an incident note to every tracker; never blocks."""
        for lane in self.lanes:
            lane.submit(lambda tracker, note=note: tracker.write_incident(note))
