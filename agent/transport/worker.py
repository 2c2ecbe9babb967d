"""The one daemon worker: decodes steps a step late, batches them, spools, sends.

`submit()` never blocks and takes no lock: a bounded deque hands items over (a full one
drops; the caller counts it) and the worker polls it every `POLL_S`, so the training
thread never pays for waking it. Batches are cut by count (`max_batch_steps`) and age
(`flush_interval_s`), written to the spool, then posted in order with backoff; a batch
leaves the spool only once the server committed it, so a crash loses at most the steps
not yet cut into a batch. Replays carry their original (run, rank, seq): never duplicated.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampwatch.agent import guard
from ampwatch.agent.transport.sender import Outcome, Sender
from ampwatch.agent.transport.spool import Spool, leftover_dirs, read_entry

_STOP = object()


class Worker:
    """Worker thread for one attachment (one run and rank)."""

    MAX_QUEUE = 4096
    BACKOFF_MIN_S = 0.5
    BACKOFF_MAX_S = 30.0
    POLL_S = 0.05
    LEFTOVER_EVERY_S = 30.0
    REGISTER_TIMEOUT_S = 2.0

    def __init__(self, settings: Any, run_body: dict, decode: Callable[[Any], dict | None],
                 extra_dropped: Callable[[], int]) -> None:
        self.settings = settings
        self.run_body = run_body
        self._decode = decode
        self._extra_dropped = extra_dropped
        self._items: deque = deque()
        self._wake = threading.Event()
        self._spool_pending = True  # until a delivery pass finds the spool empty
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()
        self.dead = False
        self.spool: Spool | None = None
        self._sender: Sender | None = None
        self._steps: list[str] = []  # step records of the next batch, JSON-encoded
        self._last_step = -1
        self._cut_runs: dict[Path, str] = {}  # recent batches: the run body they go with
        self._events: list[dict] = []
        self._first_pending = 0.0
        self._put_key: str | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._leftovers_at = 0.0
        self.delivered_batches = 0
        self.failed_steps = 0  # steps the agent itself failed to turn into records
        self._failed_seen = 0  # failed_steps at the previous flush
        self.step_offset = 0  # added to this process's step numbers (see _open)

    # ------------------------------------------------------------------ any thread
    def submit(self, item: Any) -> bool:
        """Hand an item to the worker; never blocks. False when it was dropped."""
        if self.dead or os.getpid() != self._pid:
            return False
        if self._thread is None:
            self._start()
        if len(self._items) >= self.MAX_QUEUE:
            return False
        self._items.append(item)  # atomic under the GIL
        return True

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ampwatch-agent",
                                                daemon=True)
                self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Cut a batch of everything submitted so far, spool it and try to deliver the
        spool; may block up to `timeout`. True when the spool is empty (or, offline,
        written) and no step since the previous flush was lost to an agent error."""
        done = threading.Event()
        box: dict[str, bool] = {}
        if not self.submit(("flush", done, time.monotonic() + timeout, box)):
            return False
        self._wake.set()
        done.wait(timeout)
        return box.get("delivered", False)

    def stop(self, timeout: float) -> bool:
        """Flush within `timeout`, then end the thread. Idempotent."""
        if self._thread is None or self.dead:
            self.dead = True
            return True
        delivered = self.flush(timeout)
        self.submit(_STOP)
        self._wake.set()
        self._thread.join(timeout=max(0.1, timeout))
        self.dead = True
        return delivered

    def forked(self) -> None:
        """In a forked child: the thread did not survive; never touch the parent's spool."""
        self.dead = True
        self._thread = None
        if self.spool is not None:
            self.spool.close()

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        guard.guarded("worker.open")(self._open)()
        stop = False
        while not stop:
            self._wake.wait(self.POLL_S)
            self._wake.clear()
            while self._items and not stop:
                item = self._items.popleft()
                if item is _STOP:
                    stop = True
                else:
                    guard.guarded("worker.handle")(self._handle)(item)
                    guard.guarded("worker.cut")(self._maybe_cut)()
            guard.guarded("worker.cut")(self._maybe_cut)()
            if self._spool_pending:
                guard.guarded("worker.deliver")(self._deliver)(None, False)
        if self._sender is not None:
            self._sender.close()
        if self.spool is not None:
            self.spool.close()

    def _open(self) -> None:
        s = self.settings
        self.spool = Spool.for_run(Path(s.spool_dir), s.run_id, s.rank, s.spool_max_bytes)
        last_step = self.spool.last_step
        if not s.offline:
            self._sender = Sender(s.server)
            last_step = max(last_step, self._register(self.run_body, self.REGISTER_TIMEOUT_S))
        # a resumed run (same run id) continues its step numbers instead of overwriting
        # its first steps: after what this spool or the server already holds
        self.step_offset = last_step + 1

    def _handle(self, item: Any) -> None:
        if isinstance(item, tuple) and item and item[0] == "event":
            self._note_pending()
            event = item[1]
            if self.step_offset and event.get("step") is not None:
                event["step"] += self.step_offset
            self._events.append(event)
        elif isinstance(item, tuple) and item and item[0] == "run":
            self.run_body = item[1]
        elif isinstance(item, tuple) and item and item[0] == "flush":
            _, done, deadline, box = item
            try:
                self._cut()
                failed = self.failed_steps
                box["delivered"] = self._deliver(deadline, True) and failed == self._failed_seen
                self._failed_seen = failed
            finally:
                done.set()
        else:
            try:
                record = self._decode(item)
            except Exception:
                self.failed_steps += 1  # lost: flush() must not report success
                raise
            if record is not None:
                record["step"] += self.step_offset
                self._note_pending()
                self._steps.append(json.dumps(record, allow_nan=False))
                self._last_step = record["step"]

    def _note_pending(self) -> None:
        if not self._steps and not self._events:
            self._first_pending = time.monotonic()

    def _maybe_cut(self) -> None:
        if len(self._steps) >= self.settings.max_batch_steps or (
                (self._steps or self._events)
                and time.monotonic() - self._first_pending >= self.settings.flush_interval_s):
            self._cut()

    def _cut(self) -> None:
        if self.spool is None or not (self._steps or self._events):
            return
        s = self.settings
        batch = {"rank": s.rank, "seq": None,
                 "dropped_batches": self.spool.dropped_batches,
                 "dropped_steps": (self.spool.dropped_steps + self._extra_dropped()
                                   + self.failed_steps),
                 "events": self._events}
        steps, self._steps, self._events = self._steps, [], []
        path = self.spool.append(s.run_id, s.rank, self.run_body, batch, steps,
                                 self._last_step if steps else None)
        self._cut_runs[path] = json.dumps(self.run_body, sort_keys=True)
        while len(self._cut_runs) > Spool.BODIES_KEPT:
            self._cut_runs.pop(next(iter(self._cut_runs)))
        self._spool_pending = True

    # ------------------------------------------------------------------ delivery
    def _register(self, body: dict, limit: float | None) -> int:
        """PUT the run; learn the rank's next seq. Returns the rank's last step on the
        server (-1: none, or the server could not be reached)."""
        assert self._sender is not None and self.spool is not None
        reply = self._sender.put_run(self.settings.run_id, body, limit)
        if reply.outcome is not Outcome.OK:
            return -1
        self._put_key = json.dumps(body, sort_keys=True)
        last_step = -1
        for rank in (reply.body or {}).get("ranks") or []:
            if rank.get("rank") == self.settings.rank and rank.get("next_seq") is not None:
                self.spool.next_seq = max(self.spool.next_seq, int(rank["next_seq"]))
                if rank.get("last_step") is not None:
                    last_step = int(rank["last_step"])
        return last_step

    def _backoff(self) -> None:
        self._backoff_s = min(self.BACKOFF_MAX_S, max(self.BACKOFF_MIN_S, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s

    def _deliver(self, deadline: float | None, force: bool) -> bool:
        """Send the spool in order until it is empty, the deadline passes or the server
        fails (then back off). Returns whether this run's spool is empty."""
        if self.spool is None:
            return False
        if self._sender is None:
            return True
        if not force and time.monotonic() < self._retry_at:
            return False
        if not self._deliver_spool(self.spool, deadline):
            return False
        self._spool_pending = False
        if not force and time.monotonic() >= self._leftovers_at:
            self._leftovers_at = time.monotonic() + self.LEFTOVER_EVERY_S
            self._replay_leftovers(deadline)
        return True

    def _deliver_spool(self, spool: Spool, deadline: float | None) -> bool:
        """Send the spool's batches in seq order; True when none is left."""
        assert self._sender is not None
        pending = deque(spool.pending())
        while pending:
            path = pending.popleft()
            limit = None if deadline is None else deadline - time.monotonic()
            if limit is not None and limit <= 0:
                return False
            body = spool.body(path)  # a fresh batch of ours: its JSON, and its run body
            if body is not None and self._cut_runs.get(path) == self._put_key:
                entry = None
                reply = self._sender.post_batch(self.settings.run_id, body, limit)
            else:
                entry = read_entry(path)
                key = json.dumps(entry["run"], sort_keys=True)
                if key != self._put_key:
                    reply = self._sender.put_run(entry["run_id"], entry["run"], limit)
                    if reply.outcome is not Outcome.OK:
                        self._backoff()
                        return False
                    self._put_key = key
                reply = self._sender.post_batch(entry["run_id"], entry["batch"], limit)
            if reply.outcome is Outcome.OK:
                spool.remove(path)
                self._backoff_s = 0.0
                self.delivered_batches += 1
            elif reply.outcome is Outcome.CONFLICT:
                # a resumed run whose spool started from seq 0 while the server was down:
                # the batch moves past every seq in use, so order is kept
                entry = entry or read_entry(path)
                moved = self._renumber(spool, path, entry, limit)
                if moved is None:
                    self._backoff()
                    return False
                pending.append(moved)
            elif reply.outcome is Outcome.REJECT:
                spool.reject(path)
                guard.report("worker.rejected", RuntimeError(
                    f"server refused batch {path.name}: HTTP {reply.status} {reply.body}"))
            else:
                if reply.outcome is Outcome.MISSING:
                    self._put_key = None
                self._backoff()
                return False
        return True

    def _renumber(self, spool: Spool, path: Path, entry: dict,
                  limit: float | None) -> Path | None:
        """Ask the server for the rank's next free seq (PUT) and move the batch there."""
        assert self._sender is not None
        reply = self._sender.put_run(entry["run_id"], entry["run"], limit)
        if reply.outcome is not Outcome.OK:
            return None
        ranks = (reply.body or {}).get("ranks") or []
        next_seq = max((int(r["next_seq"]) for r in ranks if r.get("rank") == entry["rank"]),
                       default=0)
        return spool.renumber(path, entry, next_seq)

    def _replay_leftovers(self, deadline: float | None) -> None:
        """Deliver batches other (finished or crashed) runs left in the spool root."""
        assert self.spool is not None
        root = Path(self.settings.spool_dir)
        for directory in leftover_dirs(root, self.spool.dir):
            other = Spool(directory, self.settings.spool_max_bytes)
            try:
                if other.locked and not self._deliver_spool(other, deadline):
                    return
            finally:
                other.close()
