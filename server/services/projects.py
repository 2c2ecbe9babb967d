"""A project's health across its runs: each run's outcome, and which of its settings
(config and environment keys) separate the runs that went bad from the healthy ones.
What the project page and `GET /api/v1/projects/{project}/health` both answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.analysis.factors import Factor, RunSettings, flatten, rank_factors
from ampwatch.server.errors import NotFound
from ampwatch.server.findings.incidents import Incident
from ampwatch.server.findings.queries import incidents_by_run
from ampwatch.server.models import Finding, Run
from ampwatch.server.schemas.projects import (
    FactorPublic,
    FactorSidePublic,
    ProjectHealthPublic,
    ProjectRunPublic,
)
from ampwatch.server.services.runs import rank_totals
from ampwatch.server.worker.queue import pending_count

ENVIRONMENT_PREFIX = "env."  # environment keys, apart from config keys of the same name


@dataclass(frozen=True)
class ProjectView:
    """A project's health and each run's settings as ranked (flattened keys), which the
    page's charts draw against the outcomes."""

    health: ProjectHealthPublic
    settings: dict[str, dict[str, Any]]  # run id -> its flattened config and environment

    def values(self, key: str) -> list[Any]:
        """`key`'s value in each run of `health.runs` (None: not set)."""
        return [self.settings.get(run.id, {}).get(key) for run in self.health.runs]


def project_health(session: Session, project: str, *,
                   tag: str | None = None) -> ProjectHealthPublic:
    """`read_project`'s health alone: the API's answer."""
    return read_project(session, project, tag=tag).health


def read_project(session: Session, project: str, *, tag: str | None = None) -> ProjectView:
    """Every run of `project` (those tagged `tag` when given), newest first, with its
    outcome: the worst of its open problems (incidents at warning or worse, as the runs
    list counts them), and its settings ranked (`rank_factors`; runs without data are
    left out of the ranking). Five queries whatever the number of runs: the runs with
    their pending batches, their rank totals, their open findings (incidents_by_run,
    with the layer order and bisect verdicts it needs) and those findings' kinds.
    NotFound when the project has no run."""
    rows = session.execute(
        select(Run.id, Run.name, Run.tags, Run.config, Run.environment,
               pending_count(Run.id).label("pending"))
        .where(Run.project == project).order_by(Run.created_at.desc(), Run.id)).all()
    if not rows:
        raise NotFound(f"no runs in project {project!r}")
    if tag:
        rows = [row for row in rows if tag in (row.tags or [])]
    ids = [row.id for row in rows]
    totals = rank_totals(session, ids)
    incidents = incidents_by_run(session, ids, open_only=True)
    kinds = _kinds(session, ids)
    runs, ranked, settings = [], [], {}
    for row in rows:
        steps = int(totals[row.id].steps or 0) if row.id in totals else 0
        problems = [i for i in incidents[row.id] if i.problem]
        outcome = _outcome(problems) if steps else "no_data"
        runs.append(ProjectRunPublic(
            id=row.id, name=row.name, tags=row.tags or [], outcome=outcome, steps=steps,
            first_bad_step=min((i.step for i in problems if i.step is not None), default=None),
            kinds=sorted({kinds[f] for i in problems for f in i.findings if f in kinds})))
        settings[row.id] = (flatten(row.config)
                            | flatten(row.environment, ENVIRONMENT_PREFIX))
        if steps:
            ranked.append(RunSettings(row.id, outcome, settings[row.id]))
    unhealthy = sum(run.outcome in ("warning", "critical") for run in runs)
    health = ProjectHealthPublic(
        project=project, tag=tag or None, runs=runs, unhealthy=unhealthy,
        healthy=sum(run.outcome == "healthy" for run in runs),
        analysis_pending=sum(row.pending for row in rows),
        factors=[factor_public(f) for f in rank_factors(ranked)])
    return ProjectView(health, settings)


def _outcome(problems: list[Incident]) -> str:
    worst = max((i.severity for i in problems), key=SEVERITY_RANK.__getitem__, default=None)
    return worst or "healthy"


def _kinds(session: Session, run_ids: list[str]) -> dict[int, str]:
    """Each open finding's kind, by finding id: one query."""
    if not run_ids:
        return {}
    return {finding: kind for finding, kind in session.execute(
        select(Finding.id, Finding.kind).where(Finding.run_id.in_(run_ids),
                                               Finding.status == "open"))}


def factor_public(factor: Factor) -> FactorPublic:
    return FactorPublic(
        key=factor.key, kind=factor.kind, threshold=factor.threshold, values=factor.values,
        sides=[FactorSidePublic(label=s.label, runs=s.runs, unhealthy=s.unhealthy,
                                warning=s.warning, critical=s.critical)
               for s in factor.sides],
        summary=factor.summary, score=factor.score, chance=factor.chance,
        separates=factor.separates, credited=factor.credited,
        confounded_with=factor.confounded_with, verdict=factor.verdict)


def project_tags(session: Session, project: str) -> list[str]:
    """Every tag of the project's runs, sorted: what its page filters by. One query."""
    return sorted({str(t) for tags in session.scalars(
        select(Run.tags).where(Run.project == project)) for t in tags or []})
