"""Upload an agent spool: the batches an offline run (AMPWATCH_MODE=offline) or an outage
left on disk.

The spool's format is wire/spool.py's (written by agent/transport/spool.py, described in
docs/agent.md). Re-uploading is harmless: the server acknowledges a
repeated (run, rank, seq) as a duplicate.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ampwatch.client.api import Client
from ampwatch.client.errors import AmpwatchError, BadRequest, NotFound
from ampwatch.wire.bundles import BUNDLE_FOLDER, bundle_step
from ampwatch.wire.bundles import SUFFIX as BUNDLE_SUFFIX
from ampwatch.wire.spool import (
    FORMAT,
    PROGRESS,
    REJECTED,
    STATE,
    SUFFIX,
    read_entry,
    recover_crash_window,
    try_lock,
)

Progress = Callable[[int, int, Path], None]


@dataclass
class SyncReport:
    """What one sync did. `rejected`: files the server refused (moved to `rejected/`
    beside them); `failed`: files left in place; `busy`: directories a running agent
    holds; `stopped`: why the sync gave up early (server down, bad token); `crash_lost`:
    steps agents decoded but were killed before spooling, reported to the server."""

    uploaded: int = 0
    duplicates: int = 0
    steps: int = 0
    runs: set[str] = field(default_factory=set)
    rejected: list[tuple[Path, str]] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)
    busy: list[Path] = field(default_factory=list)
    stopped: str | None = None
    crash_lost: int = 0  # steps an agent killed before spooling them (counted dropped)
    bundles: int = 0  # flight-recorder bundles uploaded (docs/replay.md)

    @property
    def ok(self) -> bool:
        return not (self.rejected or self.failed or self.busy or self.stopped)


def pending_batches(root: Path) -> dict[Path, list[Path]]:
    """The spool's batch files per directory, in replay order. `root` may be the spool
    root, one run's directory, or one rank's directory."""
    if not root.is_dir():
        raise FileNotFoundError(f"no spool directory at {root}")
    by_dir: dict[Path, list[Path]] = {}
    for path in sorted(root.rglob(f"*{SUFFIX}")):
        hidden = path.name.startswith(".")  # a write in progress
        if not hidden and REJECTED not in path.relative_to(root).parts:
            by_dir.setdefault(path.parent, []).append(path)
    return by_dir


def rank_dirs(root: Path) -> list[Path]:
    """The spool's rank directories under `root` (the root itself, a run's directory, or
    one rank's)."""
    if root.name.startswith("rank-"):
        return [root]
    return sorted({p.parent for name in (STATE, PROGRESS)
                   for p in (*root.glob(f"rank-*/{name}"), *root.glob(f"*/rank-*/{name}"))})


def sync_spool(client: Client, root: Path, progress: Progress | None = None) -> SyncReport:
    """Upload every pending batch under `root`, oldest first per (run, rank), registering
    each run (PUT) before its first batch and whenever its registration changes. A file is
    deleted only after the server acknowledged it; one it refuses (4xx) is moved to
    `rejected/`. Stops at the first error that would fail every request (server down,
    bad token, 5xx). Blocks on the network: up to the client's timeout per request."""
    report = SyncReport()
    for directory in rank_dirs(root):
        with _locked(directory) as locked:
            if locked:
                report.crash_lost += recover_crash_window(directory)
    batches = pending_batches(root)
    total = sum(len(files) for files in batches.values())
    done = 0
    registered: dict[str, Any] = {}
    for directory, files in batches.items():
        with _locked(directory) as locked:
            if not locked:
                report.busy.append(directory)
                done += len(files)
                continue
            for path in files:
                try:
                    _upload(client, path, registered, report)
                except BadRequest as exc:
                    report.rejected.append((path, exc.message))
                    _set_aside(path)
                except NotFound as exc:
                    report.failed.append((path, exc.message))
                except (ValueError, KeyError, TypeError, EOFError, OSError) as exc:
                    report.failed.append((path, f"unreadable spool file: {exc}"))
                except AmpwatchError as exc:
                    report.stopped = exc.message
                    return report
                done += 1
                if progress:
                    progress(done, total, path)
    for directory in rank_dirs(root):
        with _locked(directory) as locked:
            if locked and not _upload_bundles(client, directory, report):
                return report
    return report


def _upload_bundles(client: Client, directory: Path, report: SyncReport) -> bool:
    """The flight-recorder bundles a rank's spool holds (`bundles/`), after its batches:
    each deleted once the server has it. False when the sync must stop."""
    run_id, rank = directory.parent.name, int(directory.name.removeprefix("rank-"))
    for path in sorted((directory / BUNDLE_FOLDER).glob(f"step-*{BUNDLE_SUFFIX}")):
        try:
            client.upload_bundle(run_id, bundle_step(path.name), path, rank=rank)
        except BadRequest as exc:
            report.rejected.append((path, exc.message))
            path.rename(path.with_suffix(".refused"))
            continue
        except NotFound as exc:
            report.failed.append((path, exc.message))
            continue
        except AmpwatchError as exc:
            report.stopped = exc.message
            return False
        path.unlink()
        report.bundles += 1
    return True


def _upload(client: Client, path: Path, registered: dict[str, Any],
            report: SyncReport) -> None:
    entry = read_entry(path)
    if entry.get("format") != FORMAT:
        raise ValueError(f"format {entry.get('format')!r}, expected {FORMAT!r}")
    run_id, batch = entry["run_id"], entry["batch"]
    if entry.get("run") is not None and registered.get(run_id) != entry["run"]:
        client.register_run(run_id, entry["run"])
        registered[run_id] = entry["run"]
    body = gzip.compress(json.dumps(batch, allow_nan=False).encode(), compresslevel=5)
    # the agent wrote the file when it made the batch: the run was last seen then, not now
    made_at = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    ack = client.send_batch(run_id, body, gzipped=True, made_at=made_at)
    path.unlink()  # only now: the server has committed (or already had) it
    report.runs.add(run_id)
    if ack.duplicate:
        report.duplicates += 1
    else:
        report.uploaded += 1
        report.steps += ack.stored_steps


def _set_aside(path: Path) -> None:
    """Move a refused batch out of the replay order, as the agent does."""
    rejected = path.parent / REJECTED
    rejected.mkdir(exist_ok=True)
    os.replace(path, rejected / path.name)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[bool]:
    """Hold the directory's `lock` (the agent's flock) while replaying it; yields False
    when a running agent holds it."""
    descriptor, held = try_lock(directory)
    try:
        yield held
    finally:
        os.close(descriptor)
