"""`ampwatch runs delete RUN...` and `ampwatch runs archive [--older-than 90d]`: retention,
with the freed space handed back to the file system afterwards."""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime, timedelta

from ampwatch.client.api import Client
from ampwatch.client.commands import BadUsage, connect, print_json
from ampwatch.client.errors import AmpwatchError
from ampwatch.client.models import Run

_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def age(text: str) -> timedelta:
    """'90d', '12h', '30m', '2w' as a timedelta."""
    match = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 90d, 12h, 30m or 2w")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


_COMPACTION = ("Then compact the database, handing the freed space back to the file system "
               "(SQLite: VACUUM, which stalls the server's ingest while it runs, minutes on "
               "a large database).")


def register(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    delete = actions.add_parser(
        "delete", parents=[common], help="delete runs and all their data",
        description=f"Delete runs and everything stored for them. {_COMPACTION}")
    delete.add_argument("run_ids", nargs="+", metavar="RUN", help="run id")
    _compaction_options(delete)
    delete.set_defaults(func=delete_runs)

    archive = actions.add_parser(
        "archive", parents=[common], help="drop full-resolution data, keep summaries",
        description="Archive runs: drop their per-step data and FP8 samples, keep their "
                    "step summaries (the zoomed-out charts and heatmaps), layer table, "
                    "findings, totals and agent events (restart history, speed checks). "
                    f"{_COMPACTION}")
    archive.add_argument("run_ids", nargs="*", metavar="RUN", help="run id (or use filters)")
    archive.add_argument("--older-than", type=age, metavar="AGE",
                         help="runs whose last data is older than AGE (90d, 12h, 2w)")
    archive.add_argument("--project", help="only runs of this project")
    archive.add_argument("--dry-run", action="store_true", help="list what would be archived")
    _compaction_options(archive)
    archive.set_defaults(func=archive_runs)


def _compaction_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compact", action="store_true",
                        help="leave the freed space to the database (no VACUUM, no stall)")
    parser.add_argument("--compact-timeout", type=float, default=Client.COMPACT_TIMEOUT,
                        metavar="SECONDS",
                        help="how long to wait for the compaction (default %(default)g; "
                             "--timeout is for the other requests)")


def _compact(client: Client, args: argparse.Namespace, done: str) -> None:
    """Compact unless told not to; `done` says what was already done, for the error."""
    if args.no_compact:
        return
    try:
        result = client.compact(timeout=args.compact_timeout)
    except AmpwatchError as exc:
        raise type(exc)(f"{done}, but compacting the database failed: {exc.message} (a "
                        "VACUUM cut off by --compact-timeout goes on on the server)",
                        exc.status_code) from exc
    if not args.json:
        freed = result["bytes_before"] - result["bytes_after"]
        print(f"compacted the {result['dialect']} database: {freed / 2**20:,.1f} MiB handed "
              f"back ({result['bytes_after'] / 2**20:,.1f} MiB now)")


def delete_runs(args: argparse.Namespace) -> int:
    deleted: list[str] = []
    try:
        with connect(args) as client:
            for run_id in args.run_ids:
                client.delete_run(run_id)
                deleted.append(run_id)
                if not args.json:
                    print(f"deleted {run_id}")
            _compact(client, args, f"deleted {len(deleted)} run(s)")
    except AmpwatchError:
        if args.json and deleted:  # what was deleted before a later request failed
            print_json({"deleted": deleted})
        raise
    if args.json:
        print_json({"deleted": deleted})
    return 0


def _chosen(client, args: argparse.Namespace) -> tuple[list[Run], dict[str, str]]:
    """The runs to archive, and the named runs left out with why (a run found by its age
    alone is left out quietly when it is live or archived already)."""
    if not args.run_ids and args.older_than is None:
        raise BadUsage("name runs to archive or give --older-than AGE")
    runs = ([client.run(r) for r in args.run_ids] if args.run_ids
            else list(client.runs(project=args.project)))
    if args.older_than is not None:
        cutoff = datetime.now(UTC) - args.older_than
        runs = [r for r in runs if (r.last_seen_at or r.created_at) < cutoff]
    if args.project:
        runs = [r for r in runs if r.project == args.project]
    skipped = {r.id: "archived already" if r.archived_at is not None else "live"
               for r in runs if r.archived_at is not None or r.live}
    return [r for r in runs if r.id not in skipped], skipped if args.run_ids else {}


def archive_runs(args: argparse.Namespace) -> int:
    archived: list[str] = []
    skipped: dict[str, str] = {}
    try:
        with connect(args) as client:
            runs, skipped = _chosen(client, args)
            for run_id, why in skipped.items():
                if not args.json:
                    print(f"skipped {run_id}: {why}"
                          + (" (it is still sending data)" if why == "live" else ""))
            for run in runs:
                if not args.dry_run:
                    client.archive_run(run.id)
                    archived.append(run.id)
                if not args.json:
                    verb = "would archive" if args.dry_run else "archived"
                    print(f"{verb} {run.id} ({run.steps:,} steps, last data "
                          f"{(run.last_seen_at or run.created_at):%Y-%m-%d})")
            if not runs and not skipped and not args.json:
                print("no run to archive")
            if archived:
                _compact(client, args, f"archived {len(archived)} run(s)")
    except AmpwatchError:
        if args.json and archived:  # what was archived before a later request failed
            print_json({"archived": archived, "would_archive": [], "skipped": skipped})
        raise
    if args.json:
        print_json({"archived": archived,
                    "would_archive": [r.id for r in runs] if args.dry_run else [],
                    "skipped": skipped})
    return 0
