"""`ampwatch findings [RUN]` and `ampwatch check RUN --fail-on LEVEL` (for CI gates; it
waits for the run's pending analysis first)."""

from __future__ import annotations

import argparse
import sys

from ampwatch.client import render
from ampwatch.client.api import Client
from ampwatch.client.commands import BadUsage, connect, print_json
from ampwatch.client.commands.runs import incidents_text
from ampwatch.client.errors import AnalysisPending
from ampwatch.client.models import SEVERITIES, Finding, Records

ANALYSIS_WAIT_S = 60.0  # `check --wait` default: how long a run's pending analysis may take


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    findings = commands.add_parser(
        "findings", parents=[common], help="what the analysis flagged",
        description="Findings of one run, or of every run, most severe first.")
    findings.add_argument("run", metavar="RUN", nargs="?", help="run id (default: all runs)")
    findings.add_argument("--severity", choices=SEVERITIES, default="info",
                          help="only findings at or above this severity")
    findings.add_argument("--kind", help="only findings of this kind (e.g. scaler_divergence)")
    findings.add_argument("--status", choices=("open", "resolved", "all"), default="all",
                          help="only open or only resolved findings (default: all, as the "
                               "API; open first)")
    findings.set_defaults(func=list_findings)

    check = commands.add_parser(
        "check", parents=[common], help="exit 1 when a run has open findings (for CI)",
        description="Exit status 1 when RUN has open findings at or above --fail-on, 0 when "
                    "it has none, 2 when the check itself failed (server, token, run, or "
                    "analysis still pending after --wait). Waits first for the server to "
                    "judge the run's stored batches, so no finding is missed.")
    check.add_argument("run", metavar="RUN", help="run id")
    check.add_argument("--fail-on", choices=("warning", "critical"), default="critical",
                       help="the lowest severity that fails the check (default %(default)s)")
    check.add_argument("--wait", type=float, default=ANALYSIS_WAIT_S, metavar="SECONDS",
                       help="how long to wait for the analysis of the run's stored batches "
                            "(default %(default)g; 0: do not wait)")
    check.set_defaults(func=check_run)


def at_or_above(client: Client, run_id: str | None, severity: str, *, status: str | None,
                kind: str | None = None) -> Records[Finding]:
    """Findings of severity `severity` or worse, most severe first, then by run and step
    (one request per severity, so the server does the filtering)."""
    found: Records[Finding] = Records(of=Finding)
    for level in reversed(SEVERITIES[SEVERITIES.index(severity):]):
        found += client.findings(run_id, severity=level, status=status, kind=kind)
    found.sort(key=lambda f: (f.status != "open", -f.severity_rank, f.run_id, f.step or 0,
                              f.id))
    return found


def list_findings(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.run is not None:
            client.run(args.run)  # an unknown run is an error, not an empty list
        found = at_or_above(client, args.run, args.severity, kind=args.kind,
                            status=None if args.status == "all" else args.status)
    if args.json:
        print_json(found)
    elif not found:
        print("no findings")
    else:
        print(findings_table(found, with_run=args.run is None))
    return 0


def check_run(args: argparse.Namespace) -> int:
    if args.wait < 0:
        raise BadUsage("--wait must be 0 or more seconds")
    with connect(args) as client:
        run = client.run(args.run)
        if run.analysis_pending:  # findings may still come: neither pass nor fail on half
            print(f"waiting for the analysis of {run.analysis_pending} batch"
                  f"{'es' if run.analysis_pending != 1 else ''} of run {run.id} "
                  f"(up to {args.wait:g} s)", file=sys.stderr, flush=True)
            try:
                run = client.wait_for_analysis(run.id, args.wait)
            except AnalysisPending as exc:
                raise AnalysisPending(f"{exc.message} (is an analysis worker running? wait "
                                      f"longer with --wait)", exc.pending) from None
        failing = at_or_above(client, run.id, args.fail_on, status="open")
        # the cards that hold them: each told once, in its own words (never a folded
        # finding's advice against its card's)
        failing_ids = {f.id for f in failing}
        incidents = [i for i in client.incidents(run.id, status="open")
                     if failing_ids & set(i.findings)] if failing else []
    if run.status == "no_data":  # a monitor that recorded nothing must not pass a gate
        if args.json:
            print_json({"run_id": run.id, "status": run.status, "fail_on": args.fail_on,
                        "passed": False, "incidents": incidents, "findings": failing})
        print(f"run {run.id} has no steps stored: nothing to check", file=sys.stderr)
        return 2
    passed = not failing
    if args.json:
        print_json({"run_id": run.id, "status": run.status, "fail_on": args.fail_on,
                    "passed": passed, "incidents": incidents, "findings": failing})
    elif passed:
        print(f"ok: run {run.id} has no open findings at or above {args.fail_on} "
              f"(status {run.status}, {run.steps} steps)")
    else:
        counts = ", ".join(f"{n} {level}" for level in reversed(SEVERITIES)
                           if (n := sum(f.severity == level for f in failing)))
        print(incidents_text(incidents, {f.id: f for f in failing}))
        print(f"failed: run {run.id} has {len(failing)} open finding"
              f"{'s' if len(failing) != 1 else ''} at or above {args.fail_on} ({counts}) "
              f"in {len(incidents)} incident{'s' if len(incidents) != 1 else ''}",
              file=sys.stderr)
    return 0 if passed else 1


def findings_table(findings: list[Finding], *, with_run: bool) -> str:
    """One row per finding; a status column when some are resolved."""
    with_status = any(f.status != "open" for f in findings)
    headers = ["severity", *(["status"] if with_status else []), *(["run"] if with_run else []),
               "kind", "rank", "steps", "layer", "message"]
    rows = [[f.severity, *([f.status] if with_status else []),
             *([f.run_id] if with_run else []), f.kind, str(f.rank),
             render.step_range(f.step, f.last_step), f.layer or "-",
             " ".join(f.message.split())] for f in findings]
    return render.table(headers, rows, wrap_width=render.terminal_width())
