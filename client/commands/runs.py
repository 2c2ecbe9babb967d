"""`ampwatch runs` (a table of runs) and `ampwatch show RUN` (one run in a terminal)."""

from __future__ import annotations

import argparse

from ampwatch.client import render
from ampwatch.client.commands import connect, print_json, retention
from ampwatch.client.models import Finding, Incident, Run, Spike

HEALTH = ("healthy", "warning", "critical", "no_data")


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    runs = commands.add_parser("runs", parents=[common], help="list runs with their health",
                               description="Runs, newest first, with their health.")
    runs.add_argument("--project", help="only this project")
    runs.add_argument("--name", help="only runs whose name contains this")
    runs.add_argument("--status", choices=HEALTH, help="only runs with this health")
    runs.add_argument("--limit", type=int, help="at most this many (default: all)")
    runs.set_defaults(func=list_runs)
    retention.register(runs.add_subparsers(dest="action", metavar="ACTION",
                                           title="retention (optional)"), common)

    show = commands.add_parser("show", parents=[common], help="summary of one run",
                               description="One run: totals, environment and findings.")
    show.add_argument("run", metavar="RUN", help="run id")
    show.set_defaults(func=show_run)


def list_runs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        runs = client.runs(project=args.project, name=args.name, status=args.status,
                           limit=args.limit)
    if args.json:
        print_json(runs)
    elif not runs:
        print("no runs")
    else:
        print(render.table(
            ["id", "name", "project", "status", "last step", "scale", "skip rate", "problems"],
            [[r.id, r.name, r.project, r.status + state(r),
              render.number(r.last_step), render.scale(r.loss_scale),
              render.percent(r.skip_rate), problems(r)] for r in runs],
            right=(4, 5, 6, 7),
        ))
    return 0


def state(run: Run) -> str:
    """' (live)' while a batch arrived recently, ' (finished)' once every rank detached,
    ' (stopped reporting)' when it went quiet without detaching: the server's word."""
    return {"live": " (live)", "finished": " (finished)",
            "stopped": " (stopped reporting)"}.get(run.reporting, "")


def problems(run: Run) -> str:
    """Open problems, and the batches still waiting for analysis (more may come)."""
    pending = f" ({to_judge(run)})" if run.analysis_pending else ""
    return f"{run.open_problems}{pending}"


def to_judge(run: Run) -> str:
    n = run.analysis_pending
    return f"{n} batch{'es' if n != 1 else ''} still to judge"


def show_run(args: argparse.Namespace) -> int:
    with connect(args) as client:
        run = client.run(args.run)
        findings = client.findings(run.id)
        incidents = client.incidents(run.id)
        spikes = client.spikes(run.id)
    if args.json:
        print_json({"run": run, "incidents": incidents, "findings": findings,
                    "spikes": spikes})
        return 0
    print(summary(run))
    by_id = {f.id: f for f in findings}
    problems = [i for i in incidents if i.problem]
    notes = [i for i in incidents if i.status == "open" and not i.problem]
    resolved = len(incidents) - len(problems) - len(notes)
    print()
    if problems:
        print(f"Open problems ({len(problems)}):")
        print(incidents_text(problems, by_id))
    elif run.analysis_pending:
        print(f"No open problems yet: {to_judge(run)} "
              f"(`ampwatch check {run.id}` waits for them).")
    else:
        print("No open problems.")
    if notes:
        print(f"\nNotes ({len(notes)}):")
        print(incidents_text(notes, by_id))
    if resolved:
        print(f"({resolved} resolved; `ampwatch findings {run.id} --status resolved`)")
    if spikes:
        print(f"\nLoss spikes ({len(spikes)}):")
        print(spikes_text(spikes))
    return 0


def spikes_text(spikes: list[Spike]) -> str:
    """One row per spike: its step, size, likely cause and layer, the lead time its
    precursor gave, and when the loss came back."""
    return render.table(
        ["step", "peak", "x median", "cause", "layer", "precursor", "lead", "back at"],
        [[render.number(s.step), render.number(s.peak), render.number(s.ratio), s.label,
          s.layer or "-", render.number(s.precursor_step), render.number(s.lead_steps),
          "not yet" if s.recovered_at is None else render.number(s.recovered_at)]
         for s in spikes],
        right=(0, 1, 2, 5, 6, 7),
    )


def incidents_text(incidents: list[Incident], findings: dict[int, Finding]) -> str:
    """One block per incident: severity, headline (or its one finding's message), first
    step and layer, the fix, then its timeline when it holds several findings."""
    blocks = []
    for incident in incidents:
        lead = findings.get(incident.findings[0])
        headline = incident.headline or (lead.message if lead else incident.cause or "-")
        where = ", ".join(part for part in (
            f"from step {incident.step}" if incident.step is not None else "",
            f"layer {incident.layer}" if incident.layer and not incident.headline else "",
            f"rank {incident.rank}" if incident.rank else "") if part)
        lines = [f"{incident.severity.upper():<8} {headline}" + (f" ({where})" if where else "")]
        if incident.fix:
            lines.append(f"         fix: {incident.fix}")
        if len(incident.timeline) > 1:
            lines += [f"         step {render.number(entry.step):>7}  {entry.what} "
                      f"({entry.severity})" for entry in incident.timeline]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def summary(run: Run) -> str:
    """The run's fields as aligned `label: value` lines, then its ranks when several."""
    env = run.environment
    scaler = env.get("scaler") or {}
    fields = [
        ("run", f"{run.id} ({run.name})" if run.name != run.id else run.id),
        ("project", run.project),
        ("status", run.status + state(run).replace(" (", ", ").rstrip(")")),
        ("tags", ", ".join(run.tags) or "-"),
        ("created", render.moment(run.created_at)),
        ("last seen", render.moment(run.last_seen_at)),
        ("steps", f"{run.steps} (last step {render.number(run.last_step)}, "
                  f"{run.skipped} skipped, {render.percent(run.skip_rate)})"),
        ("loss scale", render.scale(run.loss_scale)),
        ("layers", str(run.n_layers)),
        ("device", " ".join(str(env[k]) for k in ("device", "device_name") if env.get(k))
         or "-"),
        ("precision", f"autocast {env.get('autocast_dtype') or 'off'}, "
                      + (f"GradScaler (growth interval {scaler.get('growth_interval')})"
                         if scaler and scaler.get("enabled", True) else "no GradScaler")),
        ("versions", ", ".join(f"{k.removesuffix('_version')} {env[k]}" for k in
                               ("torch_version", "python_version", "ampwatch_version")
                               if env.get(k)) or "-"),
    ]
    if run.analysis_pending:
        fields.append(("analysis", f"{to_judge(run)}: findings may still come"))
    losses = [("lost batches", run.lost_batches), ("dropped batches", run.dropped_batches),
              ("steps lost", run.steps_lost)]
    fields += [(label, str(count)) for label, count in losses if count]
    width = max(len(label) for label, _ in fields)
    lines = [f"{label + ':':<{width + 1}} {value}" for label, value in fields]
    lines += run.delivery_outages  # the run page's lines, as the server wrote them
    if len(run.ranks) > 1:
        lines += ["", render.table(
            ["rank", "steps", "skipped", "last step", "scale", "batches", "lost"],
            [[str(r.rank), str(r.steps), str(r.skipped), render.number(r.last_step),
              render.scale(r.loss_scale), str(r.batches), str(r.lost_batches)]
             for r in run.ranks],
            right=(0, 1, 2, 3, 4, 5, 6),
        )]
    return "\n".join(lines)
