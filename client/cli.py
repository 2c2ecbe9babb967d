"""The `ampwatch` command. Subcommands of other packages (server: serve, db; agent:
demo) plug in through the `ampwatch.cli` entry point group, so this module imports
neither the server nor torch."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampwatch", description="Numerical health of PyTorch mixed-precision training."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for plugin in sorted(entry_points(group="ampwatch.cli"), key=lambda e: e.name):
        try:
            register = plugin.load()
        except ImportError:
            continue  # that extra (server or agent) is not installed
        register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
