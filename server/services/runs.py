"""Run registration, listing and deletion, and the public view of a run."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, String, case, cast, delete, func, or_, select
from sqlalchemy.orm import Session

from ampwatch.server.analysis import service as analysis
from ampwatch.server.db import dialect_insert, writing
from ampwatch.server.errors import NotFound
from ampwatch.server.findings.incidents import Incident
from ampwatch.server.findings.queries import incidents_by_run
from ampwatch.server.models import Batch, Layer, Run, RunRank, as_utc, utcnow
from ampwatch.server.schemas.runs import (
    RankPublic,
    Reporting,
    RunPublic,
    RunsPublic,
    RunUpsert,
)
from ampwatch.server.settings import Settings
from ampwatch.server.worker.queue import pending_count
from ampwatch.wire import DELIVERY_EVENT, encode_tree

MAX_OUTAGE_LINES = 10  # the newest; older ones are counted in one more line


def get_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run with id {run_id!r}")
    return run


def run_exists(maker: Callable[[], Session], run_id: str) -> bool:
    """Whether the server knows the run, in a session of its own (middleware asks)."""
    with maker() as session:
        return session.get(Run, run_id) is not None


def upsert_run(session: Session, run_id: str, body: RunUpsert, settings: Settings) -> Run:
    """Create the run or update the fields the body names; `layers` replaces the table.
    May wait for concurrent writers (see `db.writing`)."""
    with writing(session):
        return _upsert_run(session, run_id, body, settings)


def _upsert_run(session: Session, run_id: str, body: RunUpsert, settings: Settings) -> Run:
    # Insert-if-absent first, then lock the row: DDP ranks register one run id at once,
    # and a read-then-insert lost that race (a unique violation on Postgres, a stale
    # read snapshot on SQLite). The first statement is a write, so SQLite writers queue.
    now = utcnow()
    session.execute(dialect_insert(session, Run).values(
        id=run_id, name=body.name or run_id, project=body.project or "default", tags=[],
        config={}, environment={}, status="healthy", open_findings=0, n_layers=0,
        created_at=now, updated_at=now,
    ).on_conflict_do_nothing(index_elements=[Run.id]))
    # FOR NO KEY UPDATE: ingest's inserts hold KEY SHARE on the run's row (their foreign
    # keys), which FOR UPDATE would wait for, and every batch for the PUT
    run = session.get(Run, run_id, with_for_update={"key_share": True}, populate_existing=True)
    if body.name is not None:
        run.name = body.name
    if body.project is not None:
        run.project = body.project
    if body.tags is not None:
        run.tags = list(body.tags)
    # encode_tree: a NaN inside user JSON must be stored as "NaN" (Postgres JSON has none)
    if body.config is not None:
        run.config = encode_tree(body.config)
    if body.environment is not None:
        run.environment = encode_tree(body.environment.model_dump(exclude_none=True))
    if body.layers is not None:
        session.execute(delete(Layer).where(Layer.run_id == run_id))
        session.flush()
        session.add_all(
            Layer(run_id=run_id, **encode_tree(layer.model_dump())) for layer in body.layers
        )
        run.n_layers = len(body.layers)
    run.updated_at = now
    session.flush()
    analysis.on_register(session, run, settings.analysis)
    session.commit()
    return run


def delete_run(session: Session, run_id: str) -> None:
    """Delete a run and everything stored for it."""
    with writing(session):
        run = get_run(session, run_id)
        session.delete(run)
        session.commit()


def _ranks_over(column: Any) -> Any:
    """A run's `column` over its ranks (max or sum), as a correlated subquery to sort by."""
    return select(column).where(RunRank.run_id == Run.id).correlate(Run).scalar_subquery()


# what the runs list sorts by; ties: newest first
RUN_SORTS: dict[str, Any] = {
    "created": Run.created_at,
    "name": func.lower(Run.name),
    "project": func.lower(Run.project),
    "status": case({"critical": 3, "warning": 2, "healthy": 1}, value=Run.status, else_=0),
    "last_seen": _ranks_over(func.max(RunRank.last_seen_at)),
    "last_step": _ranks_over(func.max(RunRank.last_step)),
    "skipped": _ranks_over(func.sum(RunRank.skipped)),
}


def list_runs(
    session: Session,
    settings: Settings,
    *,
    project: str | None = None,
    name: str | None = None,
    status: str | None = None,
    tag: str | None = None,
    sort: str = "-created",
    limit: int = 50,
    offset: int = 0,
) -> RunsPublic:
    """Runs newest first (or by `sort`, one of RUN_SORTS, "-" first for descending);
    `name` matches a substring, case-insensitively; `tag` one of the run's tags. Each run's
    `ranks` holds its lead rank only (`n_ranks` counts them all; `GET /runs/{id}` and
    `/runs/{id}/ranks` list every rank), so a page of runs reads one rank row a run."""
    query = select(Run)
    if project is not None:
        query = query.where(Run.project == project)
    if name:
        query = query.where(func.lower(Run.name).contains(name.lower(), autoescape=True))
    if status is not None:
        with_steps = select(RunRank.run_id).where(RunRank.steps > 0)
        if status == "no_data":
            query = query.where(Run.id.not_in(with_steps))
        else:
            query = query.where(Run.status == status, Run.id.in_(with_steps))
    if tag:
        # tags are a JSON list: match the quoted string as either encoding stores it
        text = cast(Run.tags, String)
        query = query.where(or_(*(text.contains(json.dumps(tag, ensure_ascii=ascii),
                                                autoescape=True) for ascii in (True, False))))
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    key = RUN_SORTS[sort.removeprefix("-")]
    order = key.desc() if sort.startswith("-") else key.asc()
    # each run with its pending batches, read in one statement (see `public_run`)
    page = list(session.execute(
        query.add_columns(pending_count(Run.id))
        .order_by(order, Run.created_at.desc(), Run.id).limit(limit).offset(offset)))
    ids = [run.id for run, _ in page]
    ranks, incidents = lead_ranks(session, ids), incidents_by_run(session, ids, open_only=True)
    totals = rank_totals(session, ids)
    items = [run_public(r, ranks.get(r.id, []), settings, incidents[r.id], totals.get(r.id),
                        pending) for r, pending in page]
    return RunsPublic(items=items, total=total, limit=limit, offset=offset)


def lead_rank(session: Session, run_id: str) -> RunRank | None:
    """The run's lowest numbered rank row (None: no rank sent anything)."""
    return session.scalars(select(RunRank).where(RunRank.run_id == run_id)
                           .order_by(RunRank.rank).limit(1)).first()


def lead_ranks(session: Session, run_ids: list[str]) -> dict[str, list[RunRank]]:
    """Each run's lowest numbered rank row: one read, whatever the number of ranks."""
    if not run_ids:
        return {}
    lowest = (select(RunRank.run_id, func.min(RunRank.rank).label("rank"))
              .where(RunRank.run_id.in_(run_ids)).group_by(RunRank.run_id).subquery())
    rows = session.scalars(select(RunRank).join(
        lowest, (RunRank.run_id == lowest.c.run_id) & (RunRank.rank == lowest.c.rank)))
    return {row.run_id: [row] for row in rows}


def runs_seen_since(session: Session, since: datetime) -> list[Row]:
    """Runs (id, project) with data from `since` or later by the newest of their ranks'
    `last_seen_at` (ingest never writes a run's own row). One grouped read of
    `run_ranks`; where each stands is `run_state`'s to say."""
    return list(session.execute(
        select(Run.id, Run.project).join(RunRank, RunRank.run_id == Run.id)
        .group_by(Run.id, Run.project).having(func.max(RunRank.last_seen_at) >= since)))


def run_ranks(session: Session, run_id: str) -> list[RunRank]:
    """Every rank row of the run, lowest numbered first (one row per rank: the run's
    own API and retention; the pages read `ranks.panel_rank_rows`)."""
    return list(session.scalars(select(RunRank).where(RunRank.run_id == run_id)
                                .order_by(RunRank.rank)))


def rank_totals(session: Session, run_ids: list[str]) -> dict[str, Row]:
    """Per run, its ranks summed up in SQL: one grouped row per run (n_ranks, steps,
    skipped, last_step, last_seen_at, finished ranks, lost and dropped data, the lowest
    loss scale), whatever the number of ranks. A run with no rank has no row."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(RunRank.run_id, func.count().label("n_ranks"),
               func.sum(RunRank.steps).label("steps"),
               func.sum(RunRank.skipped).label("skipped"),
               func.max(RunRank.last_step).label("last_step"),
               func.max(RunRank.reached_step).label("reached_step"),
               func.max(RunRank.last_seen_at).label("last_seen_at"),
               func.count(RunRank.finished_at).label("finished"),
               func.sum(RunRank.max_seq + 1 - RunRank.batches).label("lost_batches"),
               func.sum(RunRank.dropped_batches).label("dropped_batches"),
               func.sum(RunRank.dropped_steps).label("dropped_steps"),
               func.sum(_missing_steps()).label("missing_steps"),
               func.min(RunRank.loss_scale).label("lowest_scale"))
        .where(RunRank.run_id.in_(run_ids)).group_by(RunRank.run_id))
    return {row.run_id: row for row in rows}


def _missing_steps():
    """`RunRank.missing_steps` in SQL (no GREATEST on SQLite): the larger of the dropped
    steps and the holes up to the last step, at least 0."""
    holes = func.coalesce(RunRank.last_step + 1 - RunRank.steps, 0)
    most = case((RunRank.dropped_steps > holes, RunRank.dropped_steps), else_=holes)
    return case((most > 0, most), else_=0)


def public_run(session: Session, run: Run, settings: Settings,
               ranks: list[RunRank] | None = None) -> RunPublic:
    """`run_public` of one run: its row read again with its pending batches (one
    statement), then its totals (one aggregate row), its ranks (read unless given: the
    pages give at most `ranks.PANEL_ROWS`, the lead first) and its open incidents."""
    # what is read after a count of 0 holds all the worker wrote (its findings, the
    # run's status): on Postgres each statement reads the latest commits
    row = session.execute(select(Run, pending_count(Run.id)).where(Run.id == run.id)
                          .execution_options(populate_existing=True)).one_or_none()
    if row is None:
        raise NotFound(f"no run with id {run.id!r}")  # deleted since it was read
    run, pending = row
    public = run_public(run, run_ranks(session, run.id) if ranks is None else ranks, settings,
                        incidents_by_run(session, [run.id], open_only=True)[run.id],
                        rank_totals(session, [run.id]).get(run.id), pending)
    public.delivery_outages = delivery_outages(session, run.id)
    return public


def delivery_outages(session: Session, run_id: str) -> list[str]:
    """One line per delivery outage its agents reported (a `delivery` event, sent once
    delivery recovered), oldest first. Reads only the events of the batches that
    mention one."""
    rows = session.execute(
        select(Batch.rank, Batch.events)
        .where(Batch.run_id == run_id,
               cast(Batch.events, String).like(f'%"{DELIVERY_EVENT}"%'))
        .order_by(Batch.rank, Batch.seq)
    ).all()
    outages = [(row.rank, event.get("detail") or {}) for row in rows for event in row.events
               if isinstance(event, dict) and event.get("kind") == DELIVERY_EVENT]
    outages.sort(key=lambda outage: str(outage[1].get("start")))
    lines = [outage_line(rank, detail) for rank, detail in outages[-MAX_OUTAGE_LINES:]]
    if len(outages) > MAX_OUTAGE_LINES:
        lines.insert(0, f"Delivery was interrupted {len(outages) - MAX_OUTAGE_LINES} more "
                        "times before these.")
    return lines


def outage_line(rank: int, detail: dict) -> str:
    """'Delivery was interrupted from 2025-01-01 12:00:03 to 12:00:41 UTC (38 s): connection
    refused; 4 batches waited in the agent's spool and arrived.' (a rank's agent above 0)"""
    start, end = _moment(detail.get("start")), _moment(detail.get("end"))
    span = "for a while"
    if start is not None and end is not None:
        to = end.strftime("%H:%M:%S" if end.date() == start.date() else "%Y-%m-%d %H:%M:%S")
        span = (f"from {start:%Y-%m-%d %H:%M:%S} to {to} UTC "
                f"({max(0, round((end - start).total_seconds()))} s)")
    cause = str(detail.get("cause") or "")[:200]  # an agent's text: bounded on the page
    batches = detail.get("batches_spooled")
    waited = ""
    if isinstance(batches, int) and not isinstance(batches, bool):
        waited = (f"; {batches} batch{'' if batches == 1 else 'es'} waited in the agent's "
                  "spool and arrived")
    who = f"Rank {rank}: delivery" if rank else "Delivery"
    return f"{who} was interrupted {span}" + (f": {cause}" if cause else "") + f"{waited}."


def _moment(value: Any) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)


@dataclass(frozen=True)
class RunState:
    """Where a run stands, told the same by the page, the API, `ampwatch show` and
    `sync`, the trackers and /metrics: `reporting` (waiting, live, stopped, finished),
    when it was last seen (the time of its newest data: a late upload by `ampwatch sync`
    keeps it, see `ingest_batch`'s made_at) and the steps it lost."""

    reporting: Reporting
    last_seen_at: datetime | None
    steps_lost: int


def run_state(totals: Row | None, live_seconds: float,
              now: datetime | None = None) -> RunState:
    """The state of a run from its ranks' totals (`rank_totals`; None: no rank yet).
    Steps lost: the missing ones (dropped, holes up to the last stored step) or, when
    more, those past the last stored step that the process reached (its heartbeat) and
    never sent; `ampwatch sync` counts that tail as dropped, so it is not added twice."""
    if totals is None:
        return RunState("waiting", None, 0)
    last_seen = as_utc(totals.last_seen_at)
    unsent = 0
    if totals.reached_step is not None:
        unsent = max(0, totals.reached_step - (-1 if totals.last_step is None
                                                else totals.last_step))
    # a sync's tally counts the killed tail as dropped too: the larger, not the sum
    lost = max(int(totals.missing_steps or 0), unsent)
    if totals.n_ranks and totals.finished == totals.n_ranks:
        return RunState("finished", last_seen, lost)
    if last_seen is None:
        return RunState("waiting", None, lost)
    quiet = ((now or utcnow()) - last_seen).total_seconds()
    return RunState("live" if quiet <= live_seconds else "stopped", last_seen, lost)


def run_public(run: Run, ranks: list[RunRank], settings: Settings,
               open_incidents: list[Incident], totals: Row | None,
               analysis_pending: int) -> RunPublic:
    """The API view of a run: its fields, `totals` over its ranks (`rank_totals`; None:
    no rank), the `ranks` given (lowest numbered first: the first is the lead), its
    open incidents counted (problems: warning or critical; notes: info) and its
    `analysis_pending` batches (stored, not yet judged: findings may still come)."""
    n_ranks = totals.n_ranks if totals else 0
    # Postgres sums BIGINT to NUMERIC
    steps = int(totals.steps or 0) if totals else 0
    skipped = int(totals.skipped or 0) if totals else 0
    state = run_state(totals, settings.live_seconds)
    lead = min(ranks, key=lambda r: r.rank) if ranks else None
    return RunPublic(
        id=run.id,
        name=run.name,
        project=run.project,
        tags=run.tags,
        config=run.config,
        environment=run.environment,
        status=run.status if steps else "no_data",  # a run with no data is never healthy
        live=state.reporting == "live",
        finished=state.reporting == "finished",
        reporting=state.reporting,
        steps_lost=state.steps_lost,
        open_findings=run.open_findings,
        open_problems=sum(i.problem for i in open_incidents),
        open_notes=sum(i.status == "open" and not i.problem for i in open_incidents),
        analysis_pending=analysis_pending,
        n_layers=run.n_layers,
        steps=steps,
        skipped=skipped,
        skip_rate=skipped / steps if steps else None,
        last_step=totals.last_step if totals else None,
        loss_scale=lead.loss_scale if lead else None,
        lost_batches=int(totals.lost_batches or 0) if totals else 0,
        dropped_batches=int(totals.dropped_batches or 0) if totals else 0,
        dropped_steps=int(totals.dropped_steps or 0) if totals else 0,
        missing_steps=int(totals.missing_steps or 0) if totals else 0,
        reached_step=totals.reached_step if totals else None,
        created_at=as_utc(run.created_at),
        updated_at=as_utc(run.updated_at),
        last_seen_at=state.last_seen_at,
        archived_at=as_utc(run.archived_at),
        n_ranks=n_ranks,
        ranks=[
            RankPublic(
                rank=r.rank,
                next_seq=r.max_seq + 1,
                batches=r.batches,
                lost_batches=r.lost_batches,
                steps=r.steps,
                skipped=r.skipped,
                last_step=r.last_step,
                loss_scale=r.loss_scale,
                dropped_batches=r.dropped_batches,
                dropped_steps=r.dropped_steps,
                missing_steps=r.missing_steps,
                reached_step=r.reached_step,
                last_seen_at=as_utc(r.last_seen_at),
                finished_at=as_utc(r.finished_at),
            )
            for r in ranks
        ],
    )
