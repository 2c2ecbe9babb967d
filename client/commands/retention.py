"""`ampwatch runs delete RUN...` and `ampwatch runs archive [--older-than 90d]`: retention,
with the freed space handed back to the file system afterwards."""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime, timedelta

from ampwatch.client.commands import BadUsage, connect, print_json
from ampwatch.client.models import Run

_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def age(text: str) -> timedelta:
    """'90d', '12h', '30m', '2w' as a timedelta."""
    match = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 90d, 12h, 30m or 2w")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def register(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    delete = actions.add_parser(
        "delete", parents=[common], help="delete runs and all their data",
        description="Delete runs and everything stored for them, then hand the space back "
                    "to the file system.")
    delete.add_argument("run_ids", nargs="+", metavar="RUN", help="run id")
    delete.add_argument("--no-compact", action="store_true",
                        help="leave the freed space to the database (no VACUUM)")
    delete.set_defaults(func=delete_runs)

    archive = actions.add_parser(
        "archive", parents=[common], help="drop full-resolution data, keep summaries",
        description="Archive runs: drop their per-step data, keep their step summaries "
                    "(the zoomed-out charts and heatmaps), findings and totals.")
    archive.add_argument("run_ids", nargs="*", metavar="RUN", help="run id (or use filters)")
    archive.add_argument("--older-than", type=age, metavar="AGE",
                         help="runs whose last data is older than AGE (90d, 12h, 2w)")
    archive.add_argument("--project", help="only runs of this project")
    archive.add_argument("--dry-run", action="store_true", help="list what would be archived")
    archive.add_argument("--no-compact", action="store_true",
                         help="leave the freed space to the database (no VACUUM)")
    archive.set_defaults(func=archive_runs)


def _compact(client, args: argparse.Namespace) -> None:
    if args.no_compact:
        return
    result = client.compact()
    if not args.json:
        freed = result["bytes_before"] - result["bytes_after"]
        print(f"compacted the {result['dialect']} database: {freed / 2**20:,.1f} MiB handed "
              f"back ({result['bytes_after'] / 2**20:,.1f} MiB now)")


def delete_runs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        for run_id in args.run_ids:
            client.delete_run(run_id)
            if not args.json:
                print(f"deleted {run_id}")
        _compact(client, args)
    if args.json:
        print_json({"deleted": args.run_ids})
    return 0


def _chosen(client, args: argparse.Namespace) -> list[Run]:
    if not args.run_ids and args.older_than is None:
        raise BadUsage("name runs to archive or give --older-than AGE")
    runs = ([client.run(r) for r in args.run_ids] if args.run_ids
            else list(client.runs(project=args.project)))
    if args.older_than is not None:
        cutoff = datetime.now(UTC) - args.older_than
        runs = [r for r in runs if (r.last_seen_at or r.created_at) < cutoff]
    if args.project:
        runs = [r for r in runs if r.project == args.project]
    return [r for r in runs if r.archived_at is None and not r.live]


def archive_runs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        runs = _chosen(client, args)
        for run in runs:
            if not args.dry_run:
                client.archive_run(run.id)
            if not args.json:
                verb = "would archive" if args.dry_run else "archived"
                print(f"{verb} {run.id} ({run.steps:,} steps, last data "
                      f"{(run.last_seen_at or run.created_at):%Y-%m-%d})")
        if not runs and not args.json:
            print("no run to archive")
        if runs and not args.dry_run:
            _compact(client, args)
    if args.json:
        print_json({"archived": [] if args.dry_run else [r.id for r in runs],
                    "would_archive": [r.id for r in runs] if args.dry_run else []})
    return 0
