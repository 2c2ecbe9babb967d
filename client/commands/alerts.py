"""`ampwatch alerts` (rules and targets), `ampwatch alerts deliveries` and
`ampwatch alerts test` (send a test notification and wait for the outcome)."""

from __future__ import annotations

import argparse
import sys
import time

from ampwatch.client import render
from ampwatch.client.commands import connect, print_json
from ampwatch.client.models import Delivery

POLL_S = 0.5


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    alerts = commands.add_parser(
        "alerts", parents=[common], help="alert rules, deliveries, test notifications",
        description="The server's alert rules and targets (URLs redacted); see "
                    "docs/alerts.md to configure them.")
    alerts.set_defaults(func=show_alerts)
    sub = alerts.add_subparsers(dest="alerts_command", metavar="COMMAND")

    deliveries = sub.add_parser(
        "deliveries", parents=[common], help="notifications sent, pending or failed",
        description="Alert notifications, newest first, with their status, attempts and "
                    "the last error of each.")
    deliveries.add_argument("--status", choices=("pending", "delivered", "failed"),
                            help="only notifications with this status")
    deliveries.add_argument("--run", help="only this run's")
    deliveries.add_argument("--limit", type=int, default=50,
                            help="at most this many (%(default)s)")
    deliveries.set_defaults(func=list_deliveries)

    test = sub.add_parser(
        "test", parents=[common], help="send a test notification to the targets",
        description="Queue a test notification to every target (or --target) through the "
                    "server's outbox and wait for the outcome. Exit 0 when every one was "
                    "delivered, 1 when one failed or is still being retried.")
    test.add_argument("--target", help="only this target (by name)")
    test.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                      help="how long to wait for the outcome (default %(default)g)")
    test.set_defaults(func=send_test)


def show_alerts(args: argparse.Namespace) -> int:
    with connect(args) as client:
        alerts = client.alerts()
    if args.json:
        print_json(alerts)
        return 0
    if not alerts.targets:
        print("no alert targets configured (docs/alerts.md)")
        return 0
    print(render.table(["target", "type", "url"],
                       [[t.name, t.type, t.url] for t in alerts.targets]))
    print()
    if not alerts.rules:
        print("no alert rules: nothing is notified")
    else:
        print(render.table(
            ["rule", "severity", "projects", "kinds", "on resolve", "targets"],
            [[r.name, f">= {r.severity}", ", ".join(r.projects) or "all",
              ", ".join(r.kinds) or "all", "yes" if r.on_resolve else "no",
              ", ".join(r.targets)] for r in alerts.rules]))
    print(f"\nrun links point at {alerts.public_url}")
    return 0


def list_deliveries(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = client.deliveries(status=args.status, run_id=args.run, limit=args.limit)
    if args.json:
        print_json(found)
    elif not found:
        print("no notifications")
    else:
        print(deliveries_table(found))
    return 0


def send_test(args: argparse.Namespace) -> int:
    with connect(args) as client:
        ids = client.send_test_alert(args.target)
        deadline = time.monotonic() + args.wait
        while True:
            found = [client.delivery(i) for i in ids]
            if all(d.status != "pending" for d in found) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    if args.json:
        print_json(found)
    else:
        print(deliveries_table(found))
    ok = all(d.status == "delivered" for d in found)
    if not ok:
        print("some test notifications were not delivered (see ERROR; pending ones are "
              "still being retried)", file=sys.stderr)
    return 0 if ok else 1


def deliveries_table(deliveries: list[Delivery]) -> str:
    rows = [[str(d.id), d.status, d.event, d.target, d.rule, str(d.attempts),
             d.title + (f" (last error: {d.last_error})" if d.last_error else "")]
            for d in deliveries]
    return render.table(["id", "status", "event", "target", "rule", "attempts", "title"],
                        rows, right=(0, 5), wrap_width=render.terminal_width())
