"""The spooler thread: decodes steps a step late, batches them, writes them to the spool.

`submit()` never blocks and takes no lock: a bounded deque hands items over (a full one
drops; the caller counts it) and the worker polls it every `POLL_S`, so the training
thread never pays for waking it. Batches are cut by count (`max_batch_steps`) and age
(`flush_interval_s`) and written to the spool; the sender thread (delivery.py) posts them.
This thread never waits on the network, so a hung or failing server cannot back steps up
into the host-copy pool: a crash loses at most the steps not yet cut into a batch.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampwatch.agent import errors
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.transport.delivery import Delivery
from ampwatch.agent.transport.sender import Sender
from ampwatch.agent.transport.spool import Spool

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import StepItem
    from ampwatch.agent.mirror import Mirror


@dataclass
class EventMessage:
    """An event for the next batch, as the wire carries it (`step` None: no step)."""

    event: dict[str, Any]


@dataclass
class RunMessage:
    """The run's registration body changed (its layer table or environment)."""

    body: dict[str, Any]


@dataclass
class FlushMessage:
    """Cut a batch of everything before it; the worker then sets `no_failures` (no step
    since the previous flush was lost to an agent error) and `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    no_failures: bool = False


class StopMessage:
    """End the worker thread (after everything before it)."""


STOP = StopMessage()


class Worker:
    """Worker thread for one attachment (one run and rank)."""

    MAX_QUEUE = 16384  # as many as the host-copy pool can have in flight (buffer.py)
    POLL_S = 0.05
    REGISTER_TIMEOUT_S = 2.0

    def __init__(self, settings: AgentSettings, mirror: Mirror | None = None,
                 explicit_steps: bool = False) -> None:
        """`mirror`: the trackers that get each decoded record too; `explicit_steps`: the
        loop numbers its steps itself (no resume offset; `Attachment.step` turns it on)."""
        self.settings = settings
        self.run_body: dict[str, Any] = {}
        self._decode: Callable[[StepItem], dict | None] = lambda item: None
        self._extra_dropped: Callable[[], int] = lambda: 0
        self._items: deque = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()
        self.dead = False
        self.spool: Spool | None = None
        self.delivery: Delivery | None = None
        self._steps: list[str] = []  # step records of the next batch, JSON-encoded
        self._last_step = -1
        # the last closed step the training thread handed over (its own numbering): the
        # loop had reached it, whether or not its record is ever decoded and sent
        self._reached_step = -1
        self._progress = -1  # the last step noted in the spool's progress file
        self._run_text = ""  # run_body as JSON, and sorted (the key the sender compares)
        self._run_key = ""
        self._events: list[dict] = []
        self._first_pending = 0.0
        self._dropped_sent = 0  # the caller's dropped steps the last batch carried
        self.failed_steps = 0  # steps the agent itself failed to turn into records
        self._failed_seen = 0  # failed_steps at the previous flush
        self.step_offset = 0  # added to this process's step numbers (see _open)
        self.explicit_steps = explicit_steps
        self.mirror = mirror

    # ------------------------------------------------------------------ any thread
    def submit(self, item: StepItem | EventMessage | RunMessage | FlushMessage | StopMessage
               ) -> bool:
        """Hand an item to the worker (a closed step from the training thread, or a
        message); never blocks. False when it was dropped. Items submitted before `start`
        wait for it."""
        if self.dead or os.getpid() != self._pid:
            return False
        if len(self._items) >= self.MAX_QUEUE:
            return False
        self._items.append(item)  # atomic under the GIL
        step = getattr(item, "step", None)  # a StepItem: the loop closed this step
        if step is not None:
            self._reached_step = step
        return True

    def start(self, run_body: dict[str, Any], decode: Callable[[StepItem], dict | None],
              extra_dropped: Callable[[], int]) -> None:
        """Start the thread once: `run_body` registers the run, `decode` turns a closed
        step into its wire record (on this thread), `extra_dropped` counts the steps the
        training thread dropped before they reached the queue."""
        with self._start_lock:
            if self._thread is None and not self.dead:
                self.run_body = run_body
                self._decode, self._extra_dropped = decode, extra_dropped
                self._thread = threading.Thread(target=self._run, name="ampwatch-agent",
                                                daemon=True)
                self._thread.start()

    @property
    def delivered_batches(self) -> int:
        return self.delivery.delivered_batches if self.delivery is not None else 0

    def flush(self, timeout: float) -> bool:
        """Cut a batch of everything submitted so far, spool it and wait for the sender
        to deliver the spool; may block up to `timeout`. True when the spool is empty
        (or, offline, written) and no step since the previous flush was lost to an agent
        error."""
        deadline = time.monotonic() + timeout
        message = FlushMessage()
        if self._thread is None or not self.submit(message):
            return False
        self._wake.set()
        if not message.done.wait(timeout) or self.spool is None:
            return False
        if self.delivery is None:
            return message.no_failures  # offline: written is all there is
        return self.delivery.flush(deadline) and message.no_failures

    def stop(self, timeout: float) -> bool:
        """Flush within `timeout`, then end both threads. Idempotent."""
        if self._thread is None or self.dead:
            self.dead = True
            return True
        deadline = time.monotonic() + timeout
        delivered = self.flush(timeout)
        self.submit(STOP)
        self._wake.set()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self.dead = True
        return delivered

    def forked(self) -> None:
        """In a forked child: the threads did not survive; never touch the parent's spool."""
        self.dead = True
        self._thread = None
        self.delivery = None
        if self.spool is not None:
            self.spool.close()

    def reached_step(self) -> int:
        """The last step the training loop closed, in the run's numbering (-1: none)."""
        if self._reached_step < 0:
            return -1
        return self._reached_step + (0 if self.explicit_steps else self.step_offset)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        errors.guarded("worker.open")(self._open)()
        stop = False
        while not stop:
            self._wake.wait(self.POLL_S)
            self._wake.clear()
            while self._items and not stop:
                item = self._items.popleft()
                if isinstance(item, StopMessage):
                    stop = True
                else:
                    errors.guarded("worker.handle")(self._handle)(item)
                    errors.guarded("worker.cut")(self._maybe_cut)()
            errors.guarded("worker.cut")(self._maybe_cut)()
            if self._last_step > self._progress and self.spool is not None:
                self._progress = self._last_step
                errors.guarded("worker.progress")(self.spool.note_progress)(self._last_step)
        if self.delivery is not None:
            self.delivery.stop(timeout=1.0)
        if self.spool is not None:
            self.spool.close()

    def _open(self) -> None:
        s = self.settings
        self.spool = Spool.for_run(Path(s.spool_dir), s.run_id, s.rank, s.spool_max_bytes)
        last_step = self.spool.last_step
        if not s.offline:
            self.delivery = Delivery(s, self.spool, Sender(s.server, s.token))
            self.delivery.reached_step = self.reached_step
            self.delivery.send_event = lambda event: self.submit(EventMessage(event))
            if not s.run_id_generated:
                # a resumed run (same run id) continues its step numbers instead of
                # overwriting its first steps: after what this spool or the server holds.
                # Asking the server blocks this thread once, up to REGISTER_TIMEOUT_S.
                last_step = max(last_step, self.delivery.register(self.run_body,
                                                                  self.REGISTER_TIMEOUT_S))
            self.delivery.start()
        self.step_offset = last_step + 1

    def _handle(self, item: StepItem | EventMessage | RunMessage | FlushMessage) -> None:
        if isinstance(item, EventMessage):
            self._note_pending()
            event = item.event
            if self.step_offset and not self.explicit_steps and event.get("step") is not None:
                event["step"] += self.step_offset
            self._events.append(event)
        elif isinstance(item, RunMessage):
            self.run_body = item.body
            self._run_key = ""
        elif isinstance(item, FlushMessage):
            try:
                self._cut(final=True)
                item.no_failures = self.failed_steps == self._failed_seen
                self._failed_seen = self.failed_steps
            finally:
                item.done.set()
        else:
            try:
                record = self._decode(item)
            except Exception:
                self.failed_steps += 1  # lost: counted dropped, and flush() is not True
                raise
            if record is not None:
                if not self.explicit_steps:
                    record["step"] += self.step_offset
                self._note_pending()
                self._steps.append(json.dumps(record, allow_nan=False))
                self._last_step = record["step"]
                if self.mirror is not None:
                    self.mirror.submit(record)

    def _note_pending(self) -> None:
        if not self._steps and not self._events:
            self._first_pending = time.monotonic()

    def _maybe_cut(self) -> None:
        if len(self._steps) >= self.settings.max_batch_steps or (
                (self._steps or self._events)
                and time.monotonic() - self._first_pending >= self.settings.flush_interval_s):
            self._cut()

    def _cut(self, final: bool = False) -> None:
        """Write the pending steps and events to the spool as one batch. `final` (a
        flush): also an empty batch when only the count of dropped steps changed, so
        the server learns every drop."""
        if self.spool is None:
            return
        dropped = self._extra_dropped() + self.failed_steps
        if not (self._steps or self._events or (final and dropped != self._dropped_sent)):
            return
        s = self.settings
        if not self._run_key:
            self._run_text = json.dumps(self.run_body, allow_nan=False)
            self._run_key = json.dumps(self.run_body, sort_keys=True)
        batch = {"rank": s.rank, "seq": None, "events": self._events}
        steps, self._steps, self._events = self._steps, [], []
        self.spool.append(s.run_id, s.rank, self._run_text, batch, steps,
                          self._last_step if steps else None, extra_dropped_steps=dropped,
                          run_key=self._run_key)
        self._dropped_sent = dropped
        if self.delivery is not None:
            self.delivery.wake()
