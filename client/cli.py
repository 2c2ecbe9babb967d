"""The `ampwatch` command. The client's own commands (runs, show, findings, check, export,
sync) live in client/commands/; those of other packages (server: serve, db; agent: demo)
plug in through the `ampwatch.cli` entry point group, so this module imports neither the
server nor torch.

Exit status: 0 ok; 1 `check` found what it gates on; 2 an error (usage, server down,
unknown run, bad token; `check` of a run whose analysis is still pending after --wait),
reported in one line on stderr; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from ampwatch.client import commands as client_commands
from ampwatch.client.commands import BadUsage
from ampwatch.client.errors import AmpwatchError, ConnectionFailed, Unauthorized

ERROR_EXIT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampwatch", description="Numerical health of PyTorch mixed-precision training."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    client_commands.register(commands)
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
    except BrokenPipeError:
        # the reader went away (`ampwatch runs | head`): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except AmpwatchError as exc:
        return _fail(f"{exc.message}{_hint(exc, args)}")
    except (OSError, BadUsage) as exc:
        return _fail(str(exc) or type(exc).__name__)


def _hint(exc: AmpwatchError, args: argparse.Namespace) -> str:
    if isinstance(exc, ConnectionFailed):
        return " (is the server running? set --server or AMPWATCH_SERVER)"
    if isinstance(exc, Unauthorized):
        given = "a wrong" if getattr(args, "token", "") else "no"
        return f" ({given} token: set --token or AMPWATCH_TOKEN)"
    return ""


def _fail(message: str) -> int:
    print(f"ampwatch: error: {message}", file=sys.stderr)
    return ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
