"""The on-disk spool: every batch is written here before it is sent, deleted once the
server has committed it, and replayed in order after a crash or an outage.

Layout (documented in docs/agent.md, replayed by `ampwatch sync` without torch):
``<root>/<run_id>/rank-<rank>/<seq:012d>.json.gz``, each a gzip JSON object
``{"format": "ampwatch-spool/1", "run_id", "rank", "seq", "run": <PUT body>,
"batch": <POST body>}`` in wire encoding; sorted file names are replay order. A directory's
``lock`` file is held (``flock``) by the process writing or replaying it; ``state.json``
keeps the next sequence number and the drop counters. Disk I/O happens on the worker only.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
from pathlib import Path
from typing import Any

from ampwatch.client.wire import check_run_id

FORMAT = "ampwatch-spool/1"
SUFFIX = ".json.gz"


def batch_text(batch: dict, steps: list[str] | None = None) -> str:
    """The POST body of `batch` as JSON text; `steps`, when given, are its step records
    already encoded one JSON text each (the worker encodes a step as it decodes it, so no
    single encode holds the GIL for a whole batch)."""
    if steps is None:
        return json.dumps(batch, allow_nan=False)
    head = json.dumps({k: v for k, v in batch.items() if k != "steps"}, allow_nan=False)
    comma = ", " if len(head) > 2 else ""  # head is "{}" when steps are all there is
    return f'{head[:-1]}{comma}"steps": [{", ".join(steps)}]}}'


def encode_entry(run_id: str, rank: int, seq: int, run: dict, batch: dict | str) -> bytes:
    """A spool file: gzip of one JSON object; `batch` may be its JSON text already."""
    head = json.dumps({"format": FORMAT, "run_id": run_id, "rank": rank, "seq": seq,
                       "run": run}, allow_nan=False)
    text = batch if isinstance(batch, str) else json.dumps(batch, allow_nan=False)
    return gzip.compress(f'{head[:-1]}, "batch": {text}}}'.encode(), compresslevel=5)


def read_entry(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Spool:
    """One (run, rank) directory of the spool, locked by this process while open."""

    BODIES_KEPT = 8  # POST bodies of the newest batches kept in memory (bounded if the
    # server is down for long: older batches are read back from their files)

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked = True
        except OSError:
            self.locked = False
        state = self._read_state()
        self._sizes = {p: p.stat().st_size for p in self.pending()}
        self._steps: dict[Path, int] = {}
        self._bodies: dict[Path, bytes] = {}  # the newest appended batches' POST bodies
        last = max((int(p.name[: -len(SUFFIX)]) for p in self._sizes), default=-1)
        self.next_seq = max(int(state.get("next_seq", 0)), last + 1)
        self.dropped_batches = int(state.get("dropped_batches", 0))
        self.last_step = int(state.get("last_step", -1))  # the last step ever spooled here
        self.dropped_steps = int(state.get("dropped_steps", 0))

    @classmethod
    def for_run(cls, root: Path, run_id: str, rank: int, max_bytes: int) -> Spool:
        return cls(run_dir(root, run_id, rank), max_bytes)

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        _atomic_write(self.dir / "state.json", json.dumps({
            "next_seq": self.next_seq, "dropped_batches": self.dropped_batches,
            "dropped_steps": self.dropped_steps, "last_step": self.last_step}).encode())

    def pending(self) -> list[Path]:
        """Batch files not yet delivered, in replay order."""
        return sorted(p for p in self.dir.glob(f"*{SUFFIX}") if not p.name.startswith("."))

    @property
    def size_bytes(self) -> int:
        return sum(self._sizes.values())

    def append(self, run_id: str, rank: int, run: dict, batch: dict,
               steps: list[str] | None = None, last_step: int | None = None) -> Path:
        """Write the next batch (its `seq` is assigned here) and enforce the size bound.
        `steps`/`last_step`: the batch's step records pre-encoded (see `batch_text`) and
        the last one's step number. The POST body stays in memory for a few batches
        (`body()`), so sending a fresh batch does not decode and re-encode its file."""
        seq = self.next_seq
        batch["seq"] = seq
        if last_step is None and batch.get("steps"):
            last_step = int(batch["steps"][-1]["step"])
        if last_step is not None:
            self.last_step = max(self.last_step, last_step)
        text = batch_text(batch, steps)
        data = encode_entry(run_id, rank, seq, run, text)
        path = self.dir / f"{seq:012d}{SUFFIX}"
        _atomic_write(path, data)
        self._bodies[path] = text.encode()
        while len(self._bodies) > self.BODIES_KEPT:
            self._bodies.pop(next(iter(self._bodies)))
        self._sizes[path] = len(data)
        self._steps[path] = len(steps) if steps is not None else len(batch.get("steps", ()))
        self.next_seq = seq + 1
        self._enforce_limit()
        self._write_state()
        return path

    def renumber(self, path: Path, entry: dict[str, Any], next_seq: int) -> Path:
        """Move a batch to the next free seq (at least `next_seq`, what the server said):
        its seq was taken on the server by a run this spool did not know about."""
        seq = max(self.next_seq, next_seq)
        entry["batch"]["seq"] = seq
        new_path = self.dir / f"{seq:012d}{SUFFIX}"
        data = encode_entry(entry["run_id"], entry["rank"], seq, entry["run"], entry["batch"])
        _atomic_write(new_path, data)
        self._sizes[new_path] = len(data)
        self._steps[new_path] = len(entry["batch"].get("steps", ()))
        self.remove(path)
        self.next_seq = seq + 1
        self._write_state()
        return new_path

    def _enforce_limit(self) -> None:
        while self.size_bytes > self.max_bytes and len(self._sizes) > 1:
            oldest = min(self._sizes)
            steps = self._steps.get(oldest)
            if steps is None:
                with contextlib.suppress(OSError, ValueError):
                    steps = len(read_entry(oldest)["batch"].get("steps", ()))
            self.remove(oldest)
            self.dropped_batches += 1
            self.dropped_steps += steps or 0

    def body(self, path: Path) -> bytes | None:
        """The POST body (JSON) of a batch this process appended recently, else None."""
        return self._bodies.get(path)

    def remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._sizes.pop(path, None)
        self._steps.pop(path, None)
        self._bodies.pop(path, None)

    def reject(self, path: Path) -> None:
        """Keep a batch the server refused (4xx) aside, out of the replay order."""
        rejected = self.dir / "rejected"
        rejected.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, rejected / path.name)
        self._sizes.pop(path, None)
        self._steps.pop(path, None)
        self._bodies.pop(path, None)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def run_dir(root: Path, run_id: str, rank: int) -> Path:
    """`<root>/<run_id>/rank-<rank>`; ValueError for a run id API v1 refuses, so that no
    input can name a directory outside `root`."""
    check_run_id(run_id)
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"invalid rank {rank!r}: a rank is an integer >= 0")
    return Path(root) / run_id / f"rank-{rank}"


def spooled_last_step(root: Path, run_id: str, rank: int) -> int | None:
    """The last step a spool under `root` holds or ever held for (run, rank), or None when
    it knows none; reads `state.json` and takes no lock."""
    try:
        state = json.loads((run_dir(root, run_id, rank) / "state.json").read_text())
        last = int(state.get("last_step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return last if last >= 0 else None


def leftover_dirs(root: Path, exclude: Path) -> list[Path]:
    """Other (run, rank) directories under `root` that still hold batches."""
    found = []
    for directory in sorted(root.glob("*/rank-*")):
        if directory != exclude and any(directory.glob(f"*{SUFFIX}")):
            found.append(directory)
    return found
