"""The spool's file format, shared by the agent (agent/transport/spool.py writes it) and
`ampwatch sync` (client/sync.py replays it without torch).

Layout (docs/agent.md): `<root>/<run_id>/rank-<rank>/<seq:012d>.json.gz`, each a gzip JSON
object `{"format": "ampwatch-spool/1", "run_id", "rank", "seq", "run": <PUT body>,
"batch": <POST body>}` in wire encoding; sorted file names are replay order; names that
start with "." are writes in progress. A directory's `lock` file is flock-ed by the
process writing or replaying it; `state.json` keeps the next seq and the drop counters;
`progress` the last step the agent decoded (a crash between the two is counted dropped);
`rejected/` holds batches the server refused. Standard library only.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from pathlib import Path
from typing import Any

from ampwatch.wire.runs import check_run_id

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, every opener holds the directory
    fcntl = None  # type: ignore[assignment]

FORMAT = "ampwatch-spool/1"
SUFFIX = ".json.gz"
REJECTED = "rejected"
PROGRESS = "progress"
STATE = "state.json"
LOCK = "lock"
SPOOL_DIR_ENV = "AMPWATCH_SPOOL_DIR"


def default_spool_dir() -> Path:
    """$AMPWATCH_SPOOL_DIR, else $XDG_CACHE_HOME/ampwatch/spool (~/.cache by default):
    where the agent spools and `ampwatch sync` looks unless told otherwise."""
    if os.environ.get(SPOOL_DIR_ENV):
        return Path(os.environ[SPOOL_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ampwatch" / "spool"


def run_dir(root: Path, run_id: str, rank: int) -> Path:
    """`<root>/<run_id>/rank-<rank>`; ValueError for a run id API v1 refuses, so that no
    input can name a directory outside `root`."""
    check_run_id(run_id)
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"invalid rank {rank!r}: a rank is an integer >= 0")
    return Path(root) / run_id / f"rank-{rank}"


def batch_path(directory: Path, seq: int) -> Path:
    return directory / f"{seq:012d}{SUFFIX}"


def seq_of(path: Path) -> int:
    """The seq a batch file's name holds."""
    return int(path.name[: -len(SUFFIX)])


def batch_files(directory: Path) -> list[Path]:
    """A rank directory's batch files not yet delivered, in replay order."""
    return sorted(p for p in directory.glob(f"*{SUFFIX}") if not p.name.startswith("."))


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a hidden temporary file, then a rename): a reader
    or a crash never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def encode_entry(run_id: str, rank: int, seq: int, run: dict | str | None,
                 batch: dict | str) -> bytes:
    """A spool file: gzip of one JSON object; `run` and `batch` may be JSON text already."""
    head = json.dumps({"format": FORMAT, "run_id": run_id, "rank": rank, "seq": seq},
                      allow_nan=False)
    run_text = run if isinstance(run, str) else json.dumps(run, allow_nan=False)
    text = batch if isinstance(batch, str) else json.dumps(batch, allow_nan=False)
    return gzip.compress(f'{head[:-1]}, "run": {run_text}, "batch": {text}}}'.encode(),
                         compresslevel=5)


def read_entry(path: Path) -> dict[str, Any]:
    """A spool file's object; ValueError (or OSError, EOFError) when it is not one."""
    return json.loads(gzip.decompress(path.read_bytes()))


def read_state(directory: Path) -> dict[str, Any]:
    """A rank directory's `state.json` ({} when missing or unreadable)."""
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(directory: Path, state: dict[str, Any]) -> None:
    atomic_write(directory / STATE, json.dumps(state).encode())


def read_progress(directory: Path) -> int | None:
    """The last step the agent decoded in this directory (None: no progress file)."""
    try:
        return int((directory / PROGRESS).read_text().strip() or -1)
    except (OSError, ValueError):
        return None


def try_lock(directory: Path) -> tuple[int, bool]:
    """Open the directory's `lock` file and try to flock it without waiting: (descriptor,
    held). Closing the descriptor releases the lock; the caller closes it either way."""
    descriptor = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is None:
        return descriptor, True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return descriptor, False
    return descriptor, True


def recover_crash_window(directory: Path) -> int:
    """Count the steps an agent decoded but never cut into a batch (it was killed in
    between) as dropped: the state's counters grow by them, and a "tally" batch (no
    steps, `run` null) carries the counts to the server. Returns the steps counted.

    The caller holds the directory's lock. Reads the newest batch file (its last step may
    be newer than state.json's when the agent died between the two writes)."""
    seen = read_progress(directory)
    if seen is None:
        return 0
    state = read_state(directory)
    files = batch_files(directory)
    last_step = int(state.get("last_step", -1))
    next_seq = int(state.get("next_seq", 0))
    if files:
        next_seq = max(next_seq, seq_of(files[-1]) + 1)
        with contextlib.suppress(OSError, ValueError, KeyError, EOFError):
            steps = read_entry(files[-1])["batch"]["steps"]
            last_step = max([last_step, *(int(step["step"]) for step in steps[-1:])])
    lost = max(0, seen - last_step)
    if lost:
        rank = int(directory.name.removeprefix("rank-"))
        # every drop counted so far (the spool's, and the agent's own the batches carried)
        dropped = max(int(state.get("dropped_steps", 0)),
                      int(state.get("batch_dropped_steps", 0))) + lost
        batch = {"rank": rank, "seq": next_seq,
                 "dropped_batches": int(state.get("dropped_batches", 0)),
                 "dropped_steps": dropped, "steps": [], "events": []}
        tally = batch_path(directory, next_seq)
        atomic_write(tally, encode_entry(directory.parent.name, rank, next_seq, None, batch))
        # dated when the agent last decoded a step: `ampwatch sync` tells the server the
        # run was last seen then, not at the upload
        with contextlib.suppress(OSError):
            decoded_at = (directory / PROGRESS).stat().st_mtime
            os.utime(tally, (decoded_at, decoded_at))
        write_state(directory, {**state, "next_seq": next_seq + 1, "dropped_steps": dropped,
                                "batch_dropped_steps": dropped, "last_step": seen})
    with contextlib.suppress(FileNotFoundError):
        (directory / PROGRESS).unlink()
    return lost
