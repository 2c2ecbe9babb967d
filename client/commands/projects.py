"""`ampwatch project PROJECT`: a project's runs with their outcomes, and which settings
separate the runs that went bad (GET /api/v1/projects/{project}/health)."""

from __future__ import annotations

import argparse

from ampwatch.client import render
from ampwatch.client.commands import connect, print_json
from ampwatch.client.models import ProjectHealth


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    project = commands.add_parser(
        "project", parents=[common], help="which settings break a project's training",
        description="The runs of PROJECT with their outcomes, and each config and "
                    "environment key ranked by how well it alone separates the unhealthy "
                    "runs from the healthy ones (docs/projects.md).")
    project.add_argument("project", metavar="PROJECT", help="project name")
    project.add_argument("--tag", help="only runs with this tag")
    project.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                         help="first wait, at most 60 s, for the analysis of stored batches")
    project.set_defaults(func=show_project)


def show_project(args: argparse.Namespace) -> int:
    with connect(args) as client:
        health = client.project_health(args.project, tag=args.tag, wait=args.wait or None)
    if args.json:
        print_json(health)
    else:
        print(project_text(health, render.terminal_width()))
    return 0


def project_text(health: ProjectHealth, width: int | None = None) -> str:
    """A headline, the settings ranked (split, score, chance, verdict) and the runs."""
    tagged = f" (tag {health.tag})" if health.tag else ""
    lines = [f"project {health.project}{tagged}: {len(health.runs)} runs, "
             f"{health.unhealthy} unhealthy, {health.healthy} healthy"]
    if health.analysis_pending:
        lines.append(f"{health.analysis_pending} batches still to judge: outcomes may change")
    if health.factors:
        lines += ["", "Settings, best separating first:", render.table(
            ["#", "setting", "score", "chance", "split and verdict"],
            [[str(i), f.key, f"{f.score:.2f}",
              "-" if f.chance is None else render.percent(f.chance),
              f"{f.summary}. {f.verdict[0].upper()}{f.verdict[1:]}"
              + (f" (confounded with {', '.join(f.confounded_with)})"
                 if f.confounded_with else "")]
             for i, f in enumerate(health.factors, 1)],
            right=(0, 2, 3), wrap_width=width)]
    lines += ["", "Runs:", render.table(
        ["outcome", "run", "first bad step", "steps", "problems"],
        [[r.outcome, r.id, render.number(r.first_bad_step), str(r.steps),
          ", ".join(r.kinds) or "-"] for r in health.runs],
        right=(2, 3), wrap_width=width)]
    return "\n".join(lines)
