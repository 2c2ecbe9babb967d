"""The on-disk spool: every batch is written here before it is sent, deleted once the
server has committed it, and replayed in order after a crash or an outage.

The file format is wire/spool.py's (replayed by `ampwatch sync` without torch). A
directory's ``lock`` file is held (``flock``) by the process writing or replaying it;
``state.json`` keeps the next sequence number and the drop counters. Disk I/O happens on
the worker only.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampwatch.agent.transport.bound import PendingBatch, SpoolBound
from ampwatch.wire.spool import (
    PROGRESS,
    REJECTED,
    STATE,
    atomic_write,
    batch_files,
    batch_path,
    encode_entry,
    read_entry,
    read_state,
    recover_crash_window,
    run_dir,
    seq_of,
    try_lock,
    write_state,
)


def batch_text(batch: dict, steps: list[str] | None = None) -> str:
    """The POST body of `batch` as JSON text; `steps`, when given, are its step records
    already encoded one JSON text each (the worker encodes a step as it decodes it, so no
    single encode holds the GIL for a whole batch)."""
    if steps is None:
        return json.dumps(batch, allow_nan=False)
    head = json.dumps({k: v for k, v in batch.items() if k != "steps"}, allow_nan=False)
    comma = ", " if len(head) > 2 else ""  # head is "{}" when steps are all there is
    return f'{head[:-1]}{comma}"steps": [{", ".join(steps)}]}}'


class Spool:
    """One (run, rank) directory of the spool, locked (flock) by this process while open.

    Thread-safe: the spooler thread appends while the sender thread sends and removes.
    The bound `max_bytes` holds for the whole spool root (every run's batch files, sent
    or refused), not per run: see `SpoolBound` for what is dropped first.
    """

    BODIES_KEPT = 8  # POST bodies of the newest batches kept in memory (bounded if the
    # server is down for long: older batches are read back from their files)

    def __init__(self, directory: Path, max_bytes: int, root: Path | None = None) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None
        self._lock_fd, self.locked = try_lock(directory)
        self._mutex = threading.RLock()
        self._in_flight: Path | None = None  # the batch the sender is posting: kept
        self._progress_fd: int | None = None
        # a crashed agent's last window: counted as dropped, and reported
        self.crash_lost = recover_crash_window(directory) if self.locked else 0
        state = read_state(directory)
        self._sizes = {p: p.stat().st_size for p in self.pending()}
        self._steps: dict[Path, int] = {}
        self._recent: dict[Path, tuple[bytes, str]] = {}  # newest batches: body, run key
        last = max((seq_of(p) for p in self._sizes), default=-1)
        self.next_seq = max(int(state.get("next_seq", 0)), last + 1)
        self.dropped_batches = int(state.get("dropped_batches", 0))
        self.last_step = int(state.get("last_step", -1))  # the last step ever spooled here
        # the batches also carried the agent's own drops (full host pool): from now on
        # they are part of this count, so a resumed run's batches never count fewer
        self.dropped_steps = max(int(state.get("dropped_steps", 0)),
                                 int(state.get("batch_dropped_steps", 0)))
        self.batch_dropped_steps = self.dropped_steps
        self.bound = SpoolBound(root, max_bytes) if root is not None else None

    @classmethod
    def for_run(cls, root: Path, run_id: str, rank: int, max_bytes: int) -> Spool:
        """The spool of one (run, rank) under `root`, bounded with everything in `root`."""
        return cls(run_dir(root, run_id, rank), max_bytes, root)

    def _write_state(self) -> None:
        write_state(self.dir, {
            "next_seq": self.next_seq, "dropped_batches": self.dropped_batches,
            "dropped_steps": self.dropped_steps, "last_step": self.last_step,
            "batch_dropped_steps": self.batch_dropped_steps})

    def note_progress(self, step: int) -> None:
        """Record the last step decoded (not yet in a batch): if the process dies before
        the next batch, the next opener counts the steps in between as dropped. One
        21-byte write in place, no fsync (a killed process's writes survive it)."""
        if self._progress_fd is None:
            self._progress_fd = os.open(self.dir / PROGRESS, os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{step:>20d}\n".encode(), 0)

    def pending(self) -> list[Path]:
        """Batch files not yet delivered, in replay order."""
        return batch_files(self.dir)

    @property
    def size_bytes(self) -> int:
        with self._mutex:
            return sum(self._sizes.values())

    def append(self, run_id: str, rank: int, run: dict | str, batch: dict,
               steps: list[str] | None = None, last_step: int | None = None,
               extra_dropped_steps: int = 0, run_key: str | None = None) -> Path:
        """Write the next batch (its `seq` and drop counts are set here) within the bound.

        `steps`/`last_step`: the batch's step records pre-encoded (see `batch_text`) and
        the last one's step number; `run`: the PUT body, or its JSON text. The batch
        carries the spool's drop counts plus `extra_dropped_steps` (steps the caller
        dropped before they reached the spool), taken after room was made for it, so the
        last batch always carries every drop. The POST body and `run_key` stay in memory
        for a few batches (`recent()`): sending a fresh batch does not re-read its file.
        Costs a gzip of the batch and, when the bound is hit, a scan of the spool root.
        """
        with self._mutex:
            if last_step is None and batch.get("steps"):
                last_step = int(batch["steps"][-1]["step"])
            if last_step is not None:
                self.last_step = max(self.last_step, last_step)
            n_steps = len(steps) if steps is not None else len(batch.get("steps", ()))
            run_text = run if isinstance(run, str) else json.dumps(run, allow_nan=False)
            seq = self.next_seq
            data = b""
            for _ in range(8):  # again while making room changed the counts it carries
                counts = (self.dropped_batches, self.dropped_steps)
                batch.update(seq=seq, dropped_batches=counts[0],
                             dropped_steps=counts[1] + extra_dropped_steps)
                self.batch_dropped_steps = batch["dropped_steps"]
                text = batch_text(batch, steps)
                data = encode_entry(run_id, rank, seq, run_text, text)
                self._make_room(len(data))
                if counts == (self.dropped_batches, self.dropped_steps):
                    break
            path = batch_path(self.dir, seq)
            atomic_write(path, data)
            self._recent[path] = (text.encode(), run_key or "")
            while len(self._recent) > self.BODIES_KEPT:
                self._recent.pop(next(iter(self._recent)))
            self._sizes[path] = len(data)
            self._steps[path] = n_steps
            self.next_seq = seq + 1
            self._write_state()
            return path

    def renumber(self, path: Path, entry: dict[str, Any], next_seq: int) -> Path:
        """Move a batch to the next free seq (at least `next_seq`, what the server said):
        its seq was taken on the server by a run this spool did not know about."""
        with self._mutex:
            seq = max(self.next_seq, next_seq)
            entry["batch"]["seq"] = seq
            new_path = batch_path(self.dir, seq)
            data = encode_entry(entry["run_id"], entry["rank"], seq, entry["run"],
                                entry["batch"])
            atomic_write(new_path, data)
            self._sizes[new_path] = len(data)
            self._steps[new_path] = len(entry["batch"].get("steps", ()))
            self._forget(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self.next_seq = seq + 1
            self._write_state()
            return new_path

    def _make_room(self, incoming: int) -> None:
        """Drop batches until `incoming` more bytes fit the bound: other runs' first (see
        `SpoolBound`), then this spool's oldest (never the one being sent)."""
        if self.bound is not None:
            over = self.bound.others_bytes(self.dir) + self.size_bytes + incoming - self.max_bytes
            if over > 0:
                self._trim_others(over)
            room = self.max_bytes - self.bound.others_bytes(self.dir) - incoming
        else:
            room = self.max_bytes - incoming
        while self.size_bytes > room:
            victims = [p for p in sorted(self._sizes) if p != self._in_flight]
            if not victims:
                return
            self.drop(victims[0])

    def _trim_others(self, need: int) -> None:
        """Free at least `need` bytes from the other runs under the root, in the order
        the bound decides: refused batches first, then the undelivered batches of
        directories no live agent holds."""
        assert self.bound is not None
        others = self.bound.trim_order(self.dir)
        freed = 0
        for path in self.bound.refused_to_delete(others, need):
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                freed += size
        for directory in others:
            if freed >= need:
                break
            other = Spool(directory, self.max_bytes)
            try:
                if other.locked:  # else a live agent writes or replays it: not ours to trim
                    freed += other._trim(self.bound, need - freed)
            finally:
                other.close()
        self.bound.remeasure()

    def _trim(self, bound: SpoolBound, need: int) -> int:
        """Drop the batches `bound` picks to free `need` bytes here, and append the tally
        that carries the new counts. Returns the bytes freed net of that tally."""
        pending, run = [], None
        for path in self.pending():
            try:
                entry = read_entry(path)
            except (OSError, ValueError):
                entry = {"batch": {"steps": [None]}}  # unreadable: dropped like a batch
            batch = entry["batch"]
            run = entry.get("run") or run
            pending.append(PendingBatch(path, self._sizes.get(path, 0),
                                        len(batch.get("steps") or ()),
                                        not batch.get("steps") and not batch.get("events")))
        plan = bound.plan(pending, need, run_bytes=len(gzip.compress(json.dumps(run).encode())))
        if plan is None:
            return 0
        freed = sum(self.drop_tally(path) for path in plan.tallies)
        for victim in plan.drops:
            freed += self.drop(victim.path)
            bound.note_drop(self.dir, victim.steps)
        rank = int(self.dir.name.removeprefix("rank-"))
        path = self.append(self.dir.parent.name, rank, run if plan.keep_run else None,
                           {"steps": [], "events": []})
        return freed - path.stat().st_size

    def drop(self, path: Path) -> int:
        """Delete an undelivered batch because of the bound and count it (state.json, and
        from there the next batches' `dropped_*` fields). Returns the bytes freed."""
        with self._mutex:
            steps = self._steps.get(path)
            if steps is None:
                with contextlib.suppress(OSError, ValueError):
                    steps = len(read_entry(path)["batch"].get("steps", ()))
            freed = self._sizes.get(path, 0)
            self._forget(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self.dropped_batches += 1
            self.dropped_steps += steps or 0
            self._write_state()
            if self.bound is not None:
                self.bound.note_drop(self.dir, steps or 0)
            return freed

    def drop_tally(self, path: Path) -> int:
        """Delete a tally batch (no steps, no events) a newer one replaces; not counted:
        the counts it carried are cumulative. Returns the bytes freed."""
        with self._mutex:
            freed = self._sizes.get(path, 0)
            self.remove(path)
            return freed

    def recent(self, path: Path) -> tuple[bytes, str] | None:
        """(POST body JSON, run key) of a batch this process appended recently, else None."""
        with self._mutex:
            return self._recent.get(path)

    def body(self, path: Path) -> bytes | None:
        """The POST body (JSON) of a batch this process appended recently, else None."""
        recent = self.recent(path)
        return recent[0] if recent is not None else None

    @contextlib.contextmanager
    def sending(self, path: Path) -> Iterator[None]:
        """While the sender posts `path`, the bound never drops it (it might be counted
        dropped and still arrive)."""
        with self._mutex:
            self._in_flight = path
        try:
            yield
        finally:
            with self._mutex:
                self._in_flight = None

    def _forget(self, path: Path) -> None:
        self._sizes.pop(path, None)
        self._steps.pop(path, None)
        self._recent.pop(path, None)

    def remove(self, path: Path) -> None:
        """The server committed `path`: delete it."""
        with self._mutex:
            self._forget(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def reject(self, path: Path) -> None:
        """Keep a batch the server refused (4xx) aside, out of the replay order."""
        with self._mutex:
            rejected = self.dir / REJECTED
            rejected.mkdir(exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, rejected / path.name)
            self._forget(path)

    def close(self) -> None:
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def spooled_last_step(root: Path, run_id: str, rank: int) -> int | None:
    """The last step a spool under `root` holds or ever held for (run, rank), or None when
    it knows none; reads `state.json` and takes no lock."""
    try:
        state = json.loads((run_dir(root, run_id, rank) / STATE).read_text())
        last = int(state.get("last_step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return last if last >= 0 else None


def leftover_dirs(root: Path, exclude: Path) -> list[Path]:
    """Other (run, rank) directories under `root` that still hold batches."""
    found = []
    for directory in sorted(root.glob("*/rank-*")):
        if directory != exclude and batch_files(directory):
            found.append(directory)
    return found
