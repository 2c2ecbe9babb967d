"""`ampwatch sync [SPOOL_DIR]`: upload what an offline or interrupted agent spooled."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampwatch.client import sync
from ampwatch.client.commands import connect, print_json
from ampwatch.wire.spool import default_spool_dir

BAR_WIDTH = 30


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "sync", parents=[common], help="upload an agent spool directory",
        description="Upload the batches an agent spooled (AMPWATCH_MODE=offline, or an "
                    "outage), oldest first; each file is deleted once the server has it. "
                    "Safe to repeat. Exit status 1 when some batches were not uploaded.")
    parser.add_argument("spool", metavar="SPOOL_DIR", nargs="?", type=Path,
                        help=f"spool root, or one run's directory (default: "
                             f"$AMPWATCH_SPOOL_DIR or {default_spool_dir()})")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is drawn only when stderr is a terminal)")
    parser.set_defaults(func=sync_command)


def sync_command(args: argparse.Namespace) -> int:
    root = args.spool or default_spool_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"no spool directory at {root}")
    show = None if args.no_progress or not sys.stderr.isatty() else progress_bar
    with connect(args) as client:
        client.health()  # fail in one line, before touching files, when the server is down
        report = sync.sync_spool(client, root, progress=show)
    if show and (report.uploaded or report.duplicates or report.failed or report.rejected):
        print(file=sys.stderr)
    if args.json:
        print_json({
            "spool": str(root), "ok": report.ok, "uploaded": report.uploaded,
            "duplicates": report.duplicates, "steps": report.steps,
            "runs": sorted(report.runs),
            "rejected": [{"path": str(p), "error": e} for p, e in report.rejected],
            "failed": [{"path": str(p), "error": e} for p, e in report.failed],
            "busy": [str(p) for p in report.busy], "stopped": report.stopped,
            "crash_lost_steps": report.crash_lost, "bundles": report.bundles,
        })
    else:
        print_report(root, report)
    return 0 if report.ok else 1


def progress_bar(done: int, total: int, path: Path) -> None:
    filled = BAR_WIDTH * done // max(total, 1)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    print(f"\rsync [{bar}] {done}/{total} batches  {path.parent.parent.name}",
          end="", file=sys.stderr, flush=True)


def print_report(root: Path, report: sync.SyncReport) -> None:
    """A one-line summary on stdout; every problem on its own line on stderr."""
    if report.crash_lost:
        print(f"ampwatch sync: {report.crash_lost} steps were lost when an agent was killed "
              f"before spooling them; the server counts them as dropped", file=sys.stderr)
    if report.bundles:
        print(f"uploaded {report.bundles} flight-recorder bundles")
    if not (report.uploaded or report.duplicates or not report.ok):
        print(f"nothing to upload in {root}")
        return
    runs = ", ".join(sorted(report.runs)) or "-"
    print(f"uploaded {report.uploaded} batches ({report.steps} steps) and skipped "
          f"{report.duplicates} the server already had; runs: {runs}")
    for path, error in report.rejected:
        print(f"ampwatch sync: rejected {path} (moved to {sync.REJECTED}/): {error}",
              file=sys.stderr)
    for path, error in report.failed:
        print(f"ampwatch sync: failed {path}: {error}", file=sys.stderr)
    for directory in report.busy:
        print(f"ampwatch sync: skipped {directory}: a running agent holds it",
              file=sys.stderr)
    if report.stopped:
        print(f"ampwatch sync: stopped: {report.stopped}; the rest stays in {root}, "
              f"run sync again", file=sys.stderr)
