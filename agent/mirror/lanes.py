"""One daemon thread per tracker behind a bounded queue, so that a tracker that raises,
hangs or crawls never holds up training, ampwatch's delivery or another tracker."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ampwatch.trackers.adapters import Tracker

logger = logging.getLogger("ampwatch.agent.mirror")

Job = Callable[[Tracker], None]


class Lane:
    """Runs jobs against one tracker in order on its own thread. The first exception
    turns the lane off (logged once); a full queue (the tracker stopped answering) drops
    jobs and says so once."""

    MAX_PENDING = 256  # batches and notes waiting; at one batch a second, minutes of them
    POLL_S = 0.2

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.failed: str | None = None  # why the lane is off
        self.dropped = 0
        self._jobs: deque[Job | None] = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._told_full = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ampwatch-mirror-{tracker.name}")
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; never blocks. False when it was dropped."""
        if self.failed is not None:
            return False
        if len(self._jobs) >= self.MAX_PENDING:
            self.dropped += 1
            if not self._told_full:
                self._told_full = True
                logger.warning("ampwatch: %s has not taken what ampwatch mirrored for a "
                               "while; dropping until it does (training goes on)",
                               self.tracker.name)
            return False
        self._idle.clear()
        self._jobs.append(job)
        self._wake.set()
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Block up to `timeout` until every queued job ran; False when the tracker is
        still busy (hung, or slow)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> bool:
        """Run what is queued and the tracker's `close()` within `timeout`, then end the
        thread; a hung tracker is left behind on its daemon thread (logged)."""
        if self.failed is None:
            self.submit(lambda tracker: tracker.close())
        self._jobs.append(None)
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("ampwatch: %s did not finish what ampwatch mirrored within "
                           "%.1f s; left behind", self.tracker.name, timeout)
            return False
        return self.failed is None

    def _run(self) -> None:
        while True:
            self._wake.wait(self.POLL_S)
            self._wake.clear()
            while self._jobs:
                job = self._jobs.popleft()
                if job is None:
                    self._idle.set()
                    return
                if self.failed is None:
                    self._call(job)
            self._idle.set()

    def _call(self, job: Job) -> None:
        try:
            job(self.tracker)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure is not training's
            self.failed = f"{type(exc).__name__}: {exc}"
            self._jobs.clear()
            logger.warning("ampwatch: mirroring into %s failed (%s); ampwatch stops "
                           "mirroring there and goes on", self.tracker.name, self.failed)
