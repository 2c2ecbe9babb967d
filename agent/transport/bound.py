"""One size bound for the whole spool root, shared by every run spooled there.

What is dropped first when a new batch would not fit (documented in docs/agent.md):
1. batches the server refused (`rejected/`), of the least recently written runs first;
2. undelivered batches of other runs no live agent holds, least recently written run
   first, oldest batch first;
3. this run's own oldest undelivered batches (never the newest, never the one in flight).
Every undelivered batch dropped is counted in its run's `state.json` and in the next
batch of that run (`dropped_batches`, `dropped_steps`); when a run loses its last batch,
an empty "tally" batch takes its place so the counts still reach the server.

This module decides what to drop; the spool (spool.py, which imports it) drops it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ampwatch.wire.spool import REJECTED, SUFFIX

logger = logging.getLogger("ampwatch.agent")

TALLY_BYTES = 512  # room kept for a tally batch without the run's body (about 160 bytes)


def _files(directory: Path) -> list[Path]:
    """A rank directory's batch files, pending and rejected."""
    return [p for p in (*directory.glob(f"*{SUFFIX}"),
                        *directory.glob(f"{REJECTED}/*{SUFFIX}"))
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


@dataclass(frozen=True)
class PendingBatch:
    """An undelivered batch of a run being trimmed, as the bound weighs it."""

    path: Path
    size: int
    steps: int
    tally: bool  # no steps and no events: a newer tally replaces it


@dataclass(frozen=True)
class TrimPlan:
    """What to take out of one run's directory: `tallies` (superseded, not counted),
    `drops` (undelivered batches, counted), and whether the tally appended after them
    must carry the run's body (`keep_run`: no batch of the run is left to register it)."""

    tallies: list[Path]
    drops: list[PendingBatch]
    keep_run: bool


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
            self._others = sum(_size(p) for d in self.trim_order(exclude) for p in _files(d))
            self._measured_at = time.monotonic()
        return self._others

    def trim_order(self, exclude: Path) -> list[Path]:
        """Other rank directories, least recently written first: the order they are
        trimmed in."""
        dirs = [d for d in self.root.glob("*/rank-*") if d != exclude and d.is_dir()]
        return sorted(dirs, key=_written_at)

    def remeasure(self) -> None:
        """Measure the other runs again on the next `others_bytes` (after a trim)."""
        self._measured_at = float("-inf")

    @staticmethod
    def refused_to_delete(others: list[Path], need: int) -> list[Path]:
        """The refused batches (`rejected/`) of `others`, in their order, until `need`
        bytes are reached: deleted before anything undelivered is dropped."""
        picked, freed = [], 0
        for directory in others:
            for path in sorted(directory.glob(f"{REJECTED}/*{SUFFIX}")):
                if freed >= need:
                    break
                freed += _size(path)
                picked.append(path)
        return picked

    @staticmethod
    def plan(pending: list[PendingBatch], need: int, *, run_bytes: int) -> TrimPlan | None:
        """Which of a run's undelivered batches (oldest first) to drop so that `need` bytes
        are free net of the tally that replaces them (`TALLY_BYTES`, plus `run_bytes` for
        the run's body when its last batch goes). None when it holds only tallies: they
        keep the counts and are never dropped."""
        data = [p for p in pending if not p.tally]
        if not data:
            return None
        tallies = [p.path for p in pending if p.tally]
        freed = sum(p.size for p in pending if p.tally)
        allowance, left, drops = TALLY_BYTES, len(data), []
        for batch in data:
            if left == 1:  # the last one goes: the tally must carry the run's body
                allowance += run_bytes
            if freed >= need + allowance:
                break
            freed += batch.size
            drops.append(batch)
            left -= 1
        return TrimPlan(tallies, drops, keep_run=left == 0)

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
