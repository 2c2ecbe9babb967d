"""One size bound for the whole spool root, shared by every run spooled there.

What is dropped first when a new batch would not fit (documented in docs/agent.md):
1. batches the server refused (`rejected/`), of the least recently written runs first;
2. undelivered batches of other runs no live agent holds, least recently written run
   first, oldest batch first;
3. this run's own oldest undelivered batches (never the newest, never the one in flight).
Every undelivered batch dropped is counted in its run's `state.json` and in the next
batch of that run (`dropped_batches`, `dropped_steps`); when a run loses its last batch,
an empty "tally" batch takes its place so the counts still reach the server.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("ampwatch.agent")

SUFFIX = ".json.gz"
TALLY_BYTES = 512  # room kept for a tally batch without the run's body (about 160 bytes)


def _files(directory: Path) -> list[Path]:
    """A rank directory's batch files, pending and rejected."""
    return [p for p in (*directory.glob(f"*{SUFFIX}"), *directory.glob(f"rejected/*{SUFFIX}"))
            if not p.name.startswith(".")]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _written_at(directory: Path) -> float:
    """When a rank directory last got a batch (0 when it holds none)."""
    times = [0.0]
    for path in _files(directory):
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times)


class SpoolBound:
    """Sizes of the other runs under a spool root, and the policy that trims them.

    Their total is re-measured at most every `REFRESH_S` (a directory scan) and after a
    trim, so concurrent agents share the bound to within what they wrote meanwhile.
    """

    REFRESH_S = 5.0

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._others = 0
        self._measured_at = float("-inf")
        self._warned = False

    def others_bytes(self, exclude: Path) -> int:
        if time.monotonic() - self._measured_at >= self.REFRESH_S:
            self._others = sum(_size(p) for d in self._dirs(exclude) for p in _files(d))
            self._measured_at = time.monotonic()
        return self._others

    def _dirs(self, exclude: Path) -> list[Path]:
        """Other rank directories, least recently written first."""
        dirs = [d for d in self.root.glob("*/rank-*") if d != exclude and d.is_dir()]
        return sorted(dirs, key=_written_at)

    def trim_others(self, exclude: Path, need: int) -> int:
        """Free at least `need` bytes from other runs (refused batches first, then the
        undelivered batches of directories no live agent holds). Returns bytes freed."""
        # imported here: spool.py imports this module
        from ampwatch.agent.transport.spool import Spool, read_entry

        freed = 0
        dirs = self._dirs(exclude)
        for directory in dirs:
            for path in sorted(directory.glob(f"rejected/*{SUFFIX}")):
                if freed >= need:
                    break
                freed += _size(path)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        for directory in dirs:
            if freed >= need:
                break
            other = Spool(directory, self.max_bytes)
            try:
                if other.locked:  # else a live agent writes or replays it: not ours to trim
                    freed += self._trim(other, need - freed, read_entry)
            finally:
                other.close()
        self._measured_at = float("-inf")
        return freed

    def _trim(self, other: Any, need: int, read_entry: Any) -> int:
        """Drop `other`'s oldest undelivered batches until `need` bytes are free net of
        the tally that replaces its old ones: an empty batch after the rest that carries
        the new counts (with the run's body when no batch of it is left to register the
        run). Returns the bytes freed."""
        data, tallies, run = [], [], None
        for path in other.pending():
            try:
                entry = read_entry(path)
            except (OSError, ValueError):
                entry = {"batch": {"steps": [None]}}  # unreadable: dropped like a batch
            batch = entry["batch"]
            run = entry.get("run") or run
            if not batch.get("steps") and not batch.get("events"):
                tallies.append(path)
            else:
                data.append((path, len(batch.get("steps") or ())))
        if not data:
            return 0  # only tallies: they keep the counts, never dropped
        freed = sum(other.drop_tally(path) for path in tallies)
        allowance = TALLY_BYTES
        left = len(data)
        for path, steps in data:
            if left == 1:  # the last one goes: the tally must carry the run's body
                allowance += len(gzip.compress(json.dumps(run).encode()))
            if freed >= need + allowance:
                break
            freed += other.drop(path)
            left -= 1
            self.note_drop(other.dir, steps)
        rank = int(other.dir.name.removeprefix("rank-"))
        path = other.append(other.dir.parent.name, rank, None if left else run,
                            {"steps": [], "events": []})
        return freed - path.stat().st_size

    def note_drop(self, directory: Path, steps: int) -> None:
        """Say once per process, in the training log, that the bound is dropping data."""
        if self._warned:
            return
        self._warned = True
        logger.warning(
            "ampwatch spool %s is full (%d bytes, AMPWATCH_SPOOL_MAX_BYTES): dropping the "
            "oldest undelivered batches, first %s (%d steps); the dropped counts reach the "
            "server with the next batches. Is the server reachable?", self.root,
            self.max_bytes, directory.relative_to(self.root), steps)
