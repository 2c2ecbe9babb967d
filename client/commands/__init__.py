"""The client's subcommands of `ampwatch`: thin layers over `client.Client`.

Each module registers its commands with `register(commands, common)`; `common` is the
parent parser that gives every command --server, --token, --timeout and --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ampwatch.client.api import DEFAULT_SERVER, Client
from ampwatch.client.model_base import to_json


class BadUsage(Exception):
    """Arguments that parse but make no sense together; reported like any error."""


def register(commands: argparse._SubParsersAction) -> None:
    """Add runs, show, project, findings, check, export, sync, alerts and bundles to the
    `ampwatch` parser."""
    # imported here: those modules import this package's helpers below
    from ampwatch.client.commands import (
        alerts,
        bundles,
        export,
        findings,
        projects,
        runs,
        sync,
    )

    common = common_options()
    for module in (runs, projects, findings, export, sync, alerts, bundles):
        module.register(commands, common)


def common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("server")
    group.add_argument("--server", metavar="URL",
                       default=os.environ.get("AMPWATCH_SERVER") or DEFAULT_SERVER,
                       help="server address (AMPWATCH_SERVER, default %(default)s)")
    group.add_argument("--token", default=os.environ.get("AMPWATCH_TOKEN") or "",
                       help="API token, when the server wants one (AMPWATCH_TOKEN)")
    group.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                       help="per request (default %(default)g)")
    common.add_argument("--json", action="store_true",
                        help="print JSON (API v1 encoding) instead of text")
    return common


def connect(args: argparse.Namespace) -> Client:
    return Client(args.server, token=args.token, timeout=args.timeout)


def print_json(value: Any) -> None:
    """`value` (results, lists, dicts of them) as indented JSON on stdout."""
    json.dump(to_json(value), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
