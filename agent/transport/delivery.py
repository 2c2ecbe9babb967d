"""The sender thread: posts the spool to the server, in order, with backoff.

It is the only thread that touches the network, so a server that hangs, answers slowly or
fails for minutes delays delivery only: the spooler thread keeps turning steps into
batches on disk meanwhile (agent/transport/worker.py). A batch leaves the spool only once
the server committed it; replays carry their original (run, rank, seq): never duplicated.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ampwatch.agent import errors
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.transport.outage import OutageWatch
from ampwatch.agent.transport.sender import Outcome, Response, Sender
from ampwatch.agent.transport.spool import Spool, leftover_dirs, read_entry
from ampwatch.wire.bundles import BUNDLE_FOLDER, bundle_step
from ampwatch.wire.bundles import SUFFIX as BUNDLE_SUFFIX

logger = logging.getLogger("ampwatch.agent")


class _Request:
    """A `flush()` waiting for the spool to be sent by `deadline`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.done = threading.Event()
        self.delivered = False


class Delivery:
    """Sender thread of one attachment: its own spool first, then other runs' leftovers."""

    BACKOFF_MIN_S = 0.5
    BACKOFF_MAX_S = 30.0
    IDLE_S = 0.5  # how often an idle sender looks at the spool (new batches wake it)
    LEFTOVER_EVERY_S = 30.0

    def __init__(self, settings: AgentSettings, spool: Spool, sender: Sender) -> None:
        self.settings = settings
        self.spool = spool
        self.sender = sender
        self._wake = threading.Event()
        self._requests: list[_Request] = []
        self._requests_lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._put_key: str | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._server_wait_until = 0.0  # its Retry-After: even a flush() waits for it
        self._stopped = threading.Event()
        self._leftovers_at = 0.0
        self.delivered_batches = 0
        # says when the server cannot be reached or refuses the token, and when it is
        # back; `send_event` (the worker sets it) carries the outage to the server
        self.send_event: Callable[[dict], object] = lambda event: None
        self.outage = OutageWatch(settings, lambda event: self.send_event(event),
                                  lambda: self.delivered_batches)
        sender.on_reply = self.outage.observe
        # the last step the loop closed (the worker sets it); sent between batches, at
        # most every heartbeat_s, so a kill's lost steps are told (wire/batch.py)
        self.reached_step: Callable[[], int] = lambda: -1
        self.heartbeat_s = max(0.1, settings.flush_interval_s / 4)
        self._reached_sent = -1
        self._heartbeat_at = 0.0

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ampwatch-sender", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A batch was spooled: send it now rather than at the next idle look."""
        self._wake.set()

    def flush(self, deadline: float) -> bool:
        """Wait until the spool is sent or `deadline` (monotonic) passes; True when sent.
        Retries at once even while backing off, but never before the server's
        Retry-After has passed."""
        request = _Request(deadline)
        with self._requests_lock:
            self._requests.append(request)
        self._wake.set()
        request.done.wait(max(0.0, deadline - time.monotonic()))
        return request.delivered

    def stop(self, timeout: float) -> None:
        self._stop = True
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.1, timeout))

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while not self._stop:
            with self._requests_lock:
                requests, self._requests = self._requests, []
            if requests:
                deadline = max(r.deadline for r in requests)
                delivered = bool(errors.guarded("sender.deliver", False)(
                    self._deliver)(deadline, True))
                for request in requests:
                    request.delivered = delivered
                    request.done.set()
            else:
                errors.guarded("sender.deliver")(self._deliver)(None, False)
            idle = min(self.IDLE_S, self.heartbeat_s)
            wait = idle if self._retry_at <= time.monotonic() else min(
                self.IDLE_S * 4, self._retry_at - time.monotonic())
            self._wake.wait(max(0.01, wait))
            self._wake.clear()
        self.sender.close()

    def register(self, body: dict, limit: float | None) -> int:
        """PUT the run; learn the rank's next seq. Returns the rank's last step on the
        server (-1: none, or the server could not be reached)."""
        reply = self.sender.put_run(self.settings.run_id, body, limit)
        if reply.outcome is not Outcome.OK:
            self._refused(reply)
            if reply.retry_after is not None:  # the server is behind: wait as it asks
                self._backoff(reply)
            return -1
        self._put_key = json.dumps(body, sort_keys=True)
        last_step = -1
        for rank in (reply.body or {}).get("ranks") or []:
            if rank.get("rank") == self.settings.rank and rank.get("next_seq") is not None:
                with self.spool._mutex:
                    self.spool.next_seq = max(self.spool.next_seq, int(rank["next_seq"]))
                if rank.get("last_step") is not None:
                    last_step = int(rank["last_step"])
        return last_step

    def _backoff(self, reply: Response | None = None) -> None:
        """Wait before the next send: twice the last wait (BACKOFF_MIN_S..BACKOFF_MAX_S),
        and at least the Retry-After the server answered with (a server behind asks for
        the time it needs; sooner would only be refused again)."""
        self._backoff_s = min(self.BACKOFF_MAX_S, max(self.BACKOFF_MIN_S, self._backoff_s * 2))
        now = time.monotonic()
        asked = reply.retry_after if reply is not None else None
        if asked is not None:
            self._server_wait_until = now + asked
        self._retry_at = now + max(self._backoff_s, asked or 0.0)

    def _server_ready(self, deadline: float | None) -> bool:
        """Whether the server's Retry-After has passed, waiting for it (a flush) when it
        ends before `deadline`. Never sends early, so never loses the batch's turn."""
        wait = self._server_wait_until - time.monotonic()
        if wait <= 0:
            return True
        if deadline is None or self._server_wait_until > deadline:
            return False
        return not self._stopped.wait(wait)

    def _refused(self, reply: Response) -> None:
        """401/403 (said once by `self.outage`): the data stays spooled; retry slowly."""
        if reply.outcome is Outcome.UNAUTHORIZED:
            self._backoff_s = self.BACKOFF_MAX_S  # a token does not fix itself quickly

    def _deliver(self, deadline: float | None, force: bool) -> bool:
        """Send the spool in order until it is empty, the deadline passes or the server
        fails (then back off). Returns whether this run's spool is empty."""
        if not force and time.monotonic() < self._retry_at:
            return False
        if not self._server_ready(deadline if force else None):
            return False
        if not self._deliver_spool(self.spool, deadline):
            return False
        self.outage.drained()
        self._deliver_bundles()
        if not force:  # a flush wants the batches out, not the heartbeat
            self._heartbeat()
        if not force and time.monotonic() >= self._leftovers_at:
            self._leftovers_at = time.monotonic() + self.LEFTOVER_EVERY_S
            self._replay_leftovers(deadline)
        return True

    def _heartbeat(self) -> None:
        """With the spool sent, tell the server the step the loop reached since, at most
        every heartbeat_s (one small POST, off the training thread)."""
        step = self.reached_step()
        if step <= self._reached_sent or time.monotonic() < self._heartbeat_at:
            return
        self._heartbeat_at = time.monotonic() + self.heartbeat_s
        reply = self.sender.post_reached(self.settings.run_id, self.settings.rank, step,
                                         self.heartbeat_s)
        if reply.outcome is Outcome.OK:
            self._reached_sent = step
        else:  # a server behind or away: the heartbeat must not take its write slot again soon
            self._heartbeat_at = time.monotonic() + max(self.heartbeat_s * 10,
                                                        reply.retry_after or 0.0)

    def _deliver_bundles(self) -> None:
        """Upload the flight recorder's bundles (agent/bundle.py) once the batches before
        them are in; each leaves the folder once the server has it. A refused one (the
        server's limits) stays on this machine, renamed, and is not offered again."""
        folder = self.spool.dir / BUNDLE_FOLDER
        if not folder.is_dir():
            return
        for path in sorted(folder.glob(f"*{BUNDLE_SUFFIX}")):
            step = bundle_step(path.name)
            reply = self.sender.put_bundle(self.settings.run_id, self.settings.rank, step, path)
            if reply.outcome is Outcome.OK:
                path.unlink(missing_ok=True)
            elif reply.outcome is Outcome.REJECT:
                path.rename(path.with_suffix(".refused"))
                errors.report("sender.bundle_rejected", RuntimeError(
                    f"server refused bundle {path.name}: HTTP {reply.status}; it stays in "
                    f"{folder}"))
            else:
                self._backoff(reply)
                return

    def _deliver_spool(self, spool: Spool, deadline: float | None) -> bool:
        """Send the spool's batches in seq order; True when none is left."""
        pending = deque(spool.pending())
        while pending and not (self._stop and deadline is None):
            path = pending.popleft()
            limit = None if deadline is None else deadline - time.monotonic()
            if limit is not None and limit <= 0:
                return False
            with spool.sending(path):
                if not path.exists():
                    continue  # dropped by the bound before it could be sent
                reply, entry = self._post(spool, path, limit)
                if reply is None:
                    return False
                if reply.outcome is Outcome.OK:
                    spool.remove(path)
                    self._backoff_s = 0.0
                    self.delivered_batches += 1
                    continue
            if reply.outcome is Outcome.CONFLICT:
                # a resumed run whose spool started from seq 0 while the server was down:
                # the batch moves past every seq in use, so order is kept
                moved = self._renumber(spool, path, entry or read_entry(path), limit)
                if moved is None:
                    return False
                pending.append(moved)
            elif reply.outcome is Outcome.REJECT or (
                    reply.outcome is Outcome.MISSING and entry is not None
                    and entry["run"] is None):  # a tally for a run the server lost
                spool.reject(path)
                self.outage.refused_batch(path.name, reply)
            else:
                if reply.outcome is Outcome.MISSING:
                    self._put_key = None
                self._refused(reply)
                self._backoff(reply)
                return False
        return not pending

    def _post(self, spool: Spool, path: Path, limit: float | None
              ) -> tuple[Response | None, dict | None]:
        """POST one batch, registering its run (PUT) first when the server has another
        body. (None, None) when that PUT failed (the caller backs off)."""
        recent = spool.recent(path)  # a fresh batch of ours: its JSON, and its run key
        if recent is not None and recent[1] == self._put_key:
            return self.sender.post_batch(self.settings.run_id, recent[0], limit), None
        entry = read_entry(path)
        key = json.dumps(entry["run"], sort_keys=True)
        if entry["run"] is not None and key != self._put_key:  # a tally has no body
            reply = self.sender.put_run(entry["run_id"], entry["run"], limit)
            if reply.outcome is not Outcome.OK:
                self._refused(reply)
                self._backoff(reply)
                return None, None
            self._put_key = key
        return self.sender.post_batch(entry["run_id"], entry["batch"], limit), entry

    def _renumber(self, spool: Spool, path: Path, entry: dict,
                  limit: float | None) -> Path | None:
        """Ask the server for the rank's next free seq (PUT) and move the batch there;
        None (backing off) when the server did not answer."""
        reply = self.sender.put_run(entry["run_id"], entry["run"], limit)
        if reply.outcome is not Outcome.OK:
            self._backoff(reply)
            return None
        ranks = (reply.body or {}).get("ranks") or []
        next_seq = max((int(r["next_seq"]) for r in ranks if r.get("rank") == entry["rank"]),
                       default=0)
        return spool.renumber(path, entry, next_seq)

    def _replay_leftovers(self, deadline: float | None) -> None:
        """Deliver batches other (finished or crashed) runs left in the spool root."""
        root = Path(self.settings.spool_dir)
        for directory in leftover_dirs(root, self.spool.dir):
            other = Spool(directory, self.settings.spool_max_bytes)
            try:
                if other.locked and not self._deliver_spool(other, deadline):
                    return
            finally:
                other.close()
