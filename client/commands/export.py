"""`ampwatch export RUN --format csv|jsonl|parquet --out FILE`, and
`ampwatch export RUN --to tensorboard DIR | mlflow [MLFLOW_RUN]` (docs/trackers.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampwatch.client import export, tracker_export
from ampwatch.client.commands import BadUsage, connect, print_json


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "export", parents=[common], help="write a run's steps and layers to a file",
        description="One row per (rank, step): the step's fields, each layer's grad norm "
                    "and, on sampled steps, its activation stats. Parquet needs the "
                    "ampwatch[parquet] extra (pyarrow).")
    parser.add_argument("run", metavar="RUN", help="run id")
    parser.add_argument("--out", "-o", type=Path, metavar="FILE",
                        help="the file to write (replaced if it exists)")
    parser.add_argument("--to", nargs="+", metavar=("TRACKER", "WHERE"),
                        help="instead of a file, into a tracker: 'tensorboard DIR' (event "
                             "files), or 'mlflow [RUN_ID]' (a new MLflow run in "
                             "MLFLOW_TRACKING_URI, or that one): the ampwatch/ scalars and "
                             "incidents the agent's mirror writes (ampwatch[trackers])")
    parser.add_argument("--format", "-f", choices=export.FORMATS,
                        help="default: from the file's suffix (.csv, .jsonl, .parquet)")
    parser.add_argument("--rank", type=int, help="only this rank (default: all)")
    parser.add_argument("--start", type=int, help="first step (inclusive)")
    parser.add_argument("--end", type=int, help="last step (inclusive)")
    parser.add_argument("--steps-only", action="store_true", help="no per-layer columns")
    parser.set_defaults(func=export_run)


def export_run(args: argparse.Namespace) -> int:
    if args.to:
        return export_to_tracker(args)
    if args.out is None:
        raise BadUsage("say where: --out FILE, or --to tensorboard DIR | mlflow")
    try:
        fmt = export.format_for(args.out, args.format)
    except ValueError as exc:
        raise BadUsage(str(exc)) from None
    export.check_format_available(fmt)
    if not args.out.parent.is_dir():
        raise FileNotFoundError(f"no directory {str(args.out.parent)!r} to write "
                                f"{args.out.name!r} in")
    tty = sys.stderr.isatty()

    def progress(message: str) -> None:
        if tty:
            print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)

    with connect(args) as client:
        client.run(args.run)  # fail on an unknown run before fetching anything
        table = export.run_table(client, args.run, rank=args.rank, start=args.start,
                                 end=args.end, layers=not args.steps_only, progress=progress)
    if tty and not args.steps_only:
        print("\r\033[K", end="", file=sys.stderr)
    export.write(table, args.out, fmt)
    if args.json:
        print_json({"run_id": args.run, "path": str(args.out), "format": fmt,
                    "rows": len(table.rows), "columns": table.columns})
    else:
        print(f"wrote {len(table.rows)} rows x {len(table.columns)} columns of run "
              f"{args.run} to {args.out} ({fmt})")
    return 0


def export_to_tracker(args: argparse.Namespace) -> int:
    target, *where = args.to
    if target not in tracker_export.TARGETS or len(where) > 1:
        raise BadUsage("--to tensorboard DIR, or --to mlflow [RUN_ID]")
    if args.out is not None:
        raise BadUsage("--to writes into a tracker: leave out --out")
    tracker_export.check_target_available(target)
    with connect(args) as client:
        client.run(args.run)  # fail on an unknown run before writing anything
        try:
            out = tracker_export.tracker(target, where[0] if where else None, args.run)
        except ValueError as exc:
            raise BadUsage(str(exc)) from None
        steps, incidents = tracker_export.export(client, args.run, out, rank=args.rank or 0)
    where_to = getattr(out, "run_id", None) or (where[0] if where else "")
    if args.json:
        print_json({"run_id": args.run, "to": target, "where": where_to, "steps": steps,
                    "incidents": incidents})
    else:
        print(f"wrote {steps} steps and {incidents} incidents of run {args.run} to "
              f"{target} {where_to}")
    return 0
