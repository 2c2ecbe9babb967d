"""Ingest of one agent batch, in four named steps: validate against the run, store whole
or dedupe on (run, rank, seq), fold the rank's totals, hand to analysis; `ingest_batch`
commits or rolls back, in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace

import numpy as np
from sqlalchemy import bindparam, case, func, literal, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ampwatch.server.analysis.window_cache import BatchKey
from ampwatch.server.db import PerDialect, writing
from ampwatch.server.errors import InvalidInput, NotFound, SeqConflict
from ampwatch.server.findings.store import refresh_run_health
from ampwatch.server.models import AnalysisTask, Batch, Run, RunRank, utcnow
from ampwatch.server.schemas.batches import BatchAck, BatchIn
from ampwatch.server.schemas.common import MAX_SEQ_GAP
from ampwatch.server.settings import Settings
from ampwatch.server.store.codec import ITEMSIZE, decode_column, encode_columns
from ampwatch.server.store.fp8_samples import fp8_length_errors, store_fp8_samples
from ampwatch.server.store.restarts import (
    forget_findings,
    rebuild_summaries,
    restart_from,
    stored_last_step,
    supersede,
)
from ampwatch.server.store.rollups import fold_rank_rollups
from ampwatch.server.store.series import COMPRESSED_FORMAT, FIELD_INDEX, StepSeries, concat
from ampwatch.server.store.spike_samples import spike_length_errors, store_spike_samples
from ampwatch.server.store.storage import (
    clip_steps,
    new_batch_row,
    unpack_row,
    vector_length_errors,
)
from ampwatch.server.store.summaries import fold_batch
from ampwatch.server.worker.queue import enqueue
from ampwatch.wire import FINISHED_EVENT, encode_tree


def ingest_batch(session: Session, run_id: str, batch: BatchIn, settings: Settings,
                 hand_over: Callable[[str, int, BatchKey, StepSeries, int], None] | None = None,
                 made_at: datetime | None = None) -> BatchAck:
    """Store `batch` in one transaction; a repeated (run, rank, seq) changes nothing.

    A repeat must carry the same steps (a replay); a different batch under a used seq
    is refused with SeqConflict rather than silently dropped. May block while other
    requests ingest: on SQLite, writers of this process take turns on the session's
    `write_lock` (server/db.py); on Postgres only batches of the same rank wait for each
    other (on the rank's row), never the run's other ranks.

    The steps, in order: validate, store or dedupe, fold totals, hand to analysis. Each
    only adds to the transaction; this function alone commits or rolls it back (on a
    duplicate, and on any error). hand_over: given the batch's steps, unpacked, once they
    are committed for analysis, with the first step its judgement reads (an embedded
    worker's `RankWindows.offer`). made_at: when the batch's data was made, for a batch
    sent late (`ampwatch sync` replaying a spool): the rank's `last_seen_at` becomes it
    (never later than now, never earlier than it was), so a late upload of a dead run's
    steps does not make it live again.
    """
    with writing(session):
        try:
            target = _validate(session, run_id, batch, made_at)
            stored = _store(session, target, batch)
            if stored.duplicate:
                _check_replay(session, target, batch, stored.row)
                session.rollback()  # a replay changes nothing, not even last_seen_at
                return stored.ack(batch, target)
            folded = _fold_totals(session, target, batch, stored)
            enqueued = _analyse(session, target, batch, stored, folded, settings)
            if stored.forgot:  # findings went with the superseded steps: recount health
                refresh_run_health(session, session.get(Run, run_id))
            session.commit()
        except BaseException:
            # a failed rollback (the connection is gone) must not hide why it failed
            with contextlib.suppress(SQLAlchemyError):
                session.rollback()
            raise
    if enqueued and hand_over is not None:
        first, last = stored.row["first_step"], stored.row["last_step"]
        hand_over(run_id, batch.rank, (batch.seq, first, last, None), folded.series,
                  first - settings.analysis.history_steps)
    return stored.ack(batch, target)


@dataclass
class _Target:
    """The run and rank a batch goes to, as validation found them (the rank's row is
    locked for the transaction; made empty by validation on the rank's first batch)."""

    run_id: str
    n_layers: int
    rank_row: RunRank
    now: datetime


@dataclass
class _Stored:
    """What storing did: the packed row, and the restart it carried (its step, the steps
    and skipped steps it superseded, and whether findings went with them)."""

    row: dict
    duplicate: bool
    restart: int | None
    superseded: tuple[int, int]
    fp8: bool
    spikes: bool  # it stored spike samples (docs/spikes.md)
    forgot: bool = False

    def ack(self, batch: BatchIn, target: _Target) -> BatchAck:
        return BatchAck(run_id=target.run_id, rank=batch.rank, seq=batch.seq,
                        duplicate=self.duplicate,
                        stored_steps=0 if self.duplicate else len(batch.steps))


@dataclass
class _Folded:
    """The batch's steps as the detectors read them, and where the rank stood."""

    series: StepSeries
    rank_last_step: int | None  # the rank's last step before this batch (a restart's: before it)


def _validate(session: Session, run_id: str, batch: BatchIn,
              made_at: datetime | None = None) -> _Target:
    """The run exists, the batch's vectors fit its layer table, and its seq is not far
    past the rank's next one. Touches and locks the rank's own row (made on the rank's
    first batch), never the run's: ranks of one run commit concurrently on Postgres."""
    # The first statement is a write (on the rank's row), so a writer from another process
    # queues on SQLite's busy timeout instead of failing on a read-to-write lock upgrade.
    now = utcnow()
    seen = now if made_at is None else min(now, made_at.astimezone(UTC))
    if not _touch_rank(session, run_id, batch.rank, seen):
        raise NotFound(f"no run with id {run_id!r}: register it with PUT /api/v1/runs/{run_id}")
    run = session.execute(select(Run.n_layers, Run.archived_at).where(Run.id == run_id)).one()
    if run.archived_at is not None and batch.steps:
        # steps that arrive after an archive are live data again (the next archive drops
        # them too); the run's row is locked only on this rare path
        session.execute(update(Run).where(Run.id == run_id).values(archived_at=None))
    n_layers = run.n_layers
    errors = (vector_length_errors(batch.steps, n_layers)
              + fp8_length_errors(batch.steps, n_layers)
              + spike_length_errors(batch.steps, n_layers))
    if errors:
        raise InvalidInput("; ".join(errors))
    rank_row = session.get(RunRank, (run_id, batch.rank), populate_existing=True)
    next_seq = rank_row.max_seq + 1
    if batch.seq > next_seq + MAX_SEQ_GAP:
        raise SeqConflict(
            f"seq {batch.seq} of rank {batch.rank} is more than {MAX_SEQ_GAP} past the "
            f"next seq {next_seq}: register the run again (PUT) and continue from next_seq")
    return _Target(run_id, n_layers, rank_row, now)


def _touch_rank(session: Session, run_id: str, rank: int, now: datetime) -> bool:
    """Move the rank's `last_seen_at` up to `now` (never back: a late upload of older data
    leaves it), making its row (empty totals) on its first batch;
    the row stays locked to the transaction. False when the run does not exist. Run-level
    `last_seen_at` is the newest of its ranks' (`runs.run_public`, `runs.run_state`)."""
    return session.execute(_TOUCH_RANK(session), {"run_id": run_id, "rank": rank,
                                                  "last_seen_at": now}).first() is not None


_EMPTY_RANK = {"batches": 0, "max_seq": -1, "steps": 0, "skipped": 0, "dropped_batches": 0,
               "dropped_steps": 0}
_RANK_KEYS = ("run_id", "rank", "last_seen_at")


def _touch_rank_statement(insert):
    columns = RunRank.__table__.c
    seen = bindparam("last_seen_at", type_=columns["last_seen_at"].type)
    values = select(*(bindparam(k, type_=columns[k].type).label(k) for k in _RANK_KEYS),
                    *(literal(v, columns[k].type).label(k) for k, v in _EMPTY_RANK.items())
                    ).where(select(Run.id).where(Run.id == bindparam("run_id")).exists())
    return (insert(RunRank.__table__).from_select([*_RANK_KEYS, *_EMPTY_RANK], values)
            .on_conflict_do_update(index_elements=[RunRank.run_id, RunRank.rank],
                                   set_={"last_seen_at": case(
                                       (columns["last_seen_at"] > seen,
                                        columns["last_seen_at"]), else_=seen)})
            .returning(RunRank.rank))  # rowcount is -1 for INSERT .. SELECT on psycopg


_TOUCH_RANK = PerDialect(_touch_rank_statement)
# Core, not ORM: an ORM insert given one row's values at execute takes the bulk path
_INSERT_BATCH = PerDialect(lambda insert: insert(Batch.__table__).on_conflict_do_nothing()
                           .returning(Batch.__table__.c.seq))


def _store(session: Session, target: _Target, batch: BatchIn) -> _Stored:
    """Insert the batch's row unless (run, rank, seq) is taken (then `duplicate`); a
    restart first marks the steps it replaces as superseded. Stores its FP8 and spike
    samples."""
    run_id = target.run_id
    events = encode_tree([e.model_dump() for e in batch.events])
    restart_event = restart_from(events)
    restart = None if restart_event is None else restart_event["step"]
    superseded, forgot = (0, 0), False
    if restart is not None:
        previous_last = stored_last_step(session, run_id, batch.rank)
        superseded = supersede(session, run_id, batch.rank, restart)
        forgot = forget_findings(session, run_id, batch.rank, restart)
        restart_event["detail"] = {**restart_event.get("detail", {}),
                                   "previous_last_step": previous_last,
                                   "superseded_steps": superseded[0]}
    row = new_batch_row(run_id, batch.rank, batch.seq, batch.steps, target.n_layers, events)
    inserted = session.execute(_INSERT_BATCH(session), encode_columns(row)).first() is not None
    fp8 = inserted and store_fp8_samples(session, run_id, batch.rank, batch.steps,
                                         target.n_layers)
    spikes = inserted and store_spike_samples(session, run_id, batch.rank, batch.steps,
                                              target.n_layers)
    return _Stored(row, not inserted, restart, superseded, bool(fp8), bool(spikes), forgot)


def _check_replay(session: Session, target: _Target, batch: BatchIn, row: dict) -> None:
    """A batch under a used seq must be a replay of the stored one, else SeqConflict."""
    kept = session.execute(select(*_CONTENT).where(
        Batch.run_id == target.run_id, Batch.rank == batch.rank, Batch.seq == batch.seq)).one()
    if not _same_content(kept, row):
        raise SeqConflict(
            f"seq {batch.seq} of rank {batch.rank} already holds steps "
            f"{kept.first_step}..{kept.last_step} with other content: this batch is not "
            f"a replay. Register the run again (PUT) and continue from next_seq")


def _fold_totals(session: Session, target: _Target, batch: BatchIn,
                 stored: _Stored) -> _Folded:
    """Add the batch to the rank's totals, layer statistics and step summaries."""
    run_id, row, restart = target.run_id, stored.row, stored.restart
    series = unpack_row(SimpleNamespace(**row), target.n_layers, with_layers=True,
                        with_acts=True)
    rank_row = target.rank_row
    # a restart's steps are the rank's newest, whatever their numbers
    rank_last_step = rank_row.last_step if restart is None else restart - 1
    new_steps, new_skipped = len(series), int(series.skipped.sum())
    if restart is not None:
        rank_row.steps -= stored.superseded[0]
        rank_row.skipped -= stored.superseded[1]
        rank_row.last_step = restart - 1 if restart > 0 else None
    # steps that may repeat stored ones (no restart): counted and summarised once
    behind = (restart is None and len(series) > 0 and rank_last_step is not None
              and row["first_step"] <= rank_last_step)
    if behind:
        session.flush()
        new_steps, new_skipped = _unique_step_delta(session, run_id, batch.rank, batch.seq,
                                                    row["first_step"], row["last_step"])
    _add_counts(rank_row, batch, series, new_steps, new_skipped)
    _note_finished(rank_row, batch, target.now)
    fold_rank_rollups(session, rank_row, series, n_layers=target.n_layers,
                      rebuild_window=restart is not None or behind)
    if behind:  # refold the buckets it touches from what reads see (its copy wins)
        rebuild_summaries(session, run_id, batch.rank, row["first_step"], row["last_step"])
    else:
        fold_batch(session, run_id, batch.rank, series)
    session.flush()
    return _Folded(series, rank_last_step)


def _analyse(session: Session, target: _Target, batch: BatchIn, stored: _Stored,
             folded: _Folded, settings: Settings) -> bool:
    """Hand the batch to the detectors: a task on the analysis queue, in this transaction
    (server/worker/analysis_worker.py judges it off the request path), with what the
    rank's judgement depends on as this request saw it. False when there is nothing to judge."""
    # a batch holding only the detach's "finished" event has nothing to analyse (an empty
    # window would look like every condition had ended)
    if not settings.analysis.enabled or (
            not len(folded.series)
            and all(event.kind == FINISHED_EVENT for event in batch.events)):
        return False
    run = session.get(Run, target.run_id)
    after = target.rank_row.last_step
    last = int(folded.series.steps[-1]) if len(folded.series) else -1
    enqueue(session, AnalysisTask(
        run_id=target.run_id, rank=batch.rank, seq=batch.seq,
        rank_last_step=folded.rank_last_step, current=after is None or after <= last,
        fp8=stored.fp8, spikes=stored.spikes,
        ranks_through=_all_ranks_through(session, run, batch.rank, folded.rank_last_step,
                                         after),
        enqueued_at=target.now))
    return True


def _note_finished(rank_row: RunRank, batch: BatchIn, now) -> None:
    """The agent's detach sends a `finished` event with its last batch: the rank is done
    now, not when `live_seconds` have passed. Steps sent later (a resumed run) make it
    train again."""
    if any(event.kind == FINISHED_EVENT for event in batch.events):
        rank_row.finished_at = now
    elif batch.steps:
        rank_row.finished_at = None


def _all_ranks_through(session: Session, run: Run, rank: int, before: int | None,
                       after: int | None) -> int | None:
    """The last step every rank of the run has sent, when this batch moved it forward
    (else None): the ranks are compared once per such advance. Needs every rank of the
    run's world size to have sent steps.

    The floor (the lowest last step of the other ranks) is read from the two lowest
    entries of `ix_run_ranks_last_step`, and it can only move when this rank was below
    it; only then are the run's ranks counted (about once per round of R batches), so a
    batch costs the same at 64 ranks as at 4,096."""
    world = (run.environment or {}).get("world_size")
    if not isinstance(world, int) or world < 2 or after is None:
        return None
    of_run = RunRank.run_id == run.id
    lowest = session.execute(select(RunRank.rank, RunRank.last_step)
                             .where(of_run, RunRank.last_step.is_not(None))
                             .order_by(RunRank.last_step).limit(2)).all()
    floor = next((row.last_step for row in lowest if row.rank != rank), None)
    if floor is None:  # no other rank has sent a step
        return None
    through = min(floor, after)
    previous = -1 if before is None else min(floor, before)
    if through <= previous:  # another rank is at or below this one: the floor stays
        return None
    count, with_steps = session.execute(
        select(func.count(), func.count(RunRank.last_step))
        .where(of_run, RunRank.rank != rank)).one()
    if count + 1 < world or with_steps < count:
        return None
    return through


# what makes two batches under one seq the same batch (a replay)
# what a replay must repeat: its steps, and its per-layer blocks when the layer table kept
# its length (the blocks are only comparable then)
_STEP_COLUMNS = ("first_step", "last_step", "n_steps", "scalars", "present")
_LAYER_COLUMNS = ("layer_grad", "act_step", "act_absmax", "act_dtype", "act_time",
                  "act_grad_zero")
_CONTENT = [getattr(Batch, c)
            for c in (*_STEP_COLUMNS, *_LAYER_COLUMNS, "n_layers", "events", "format")]


def _same_content(kept, row: dict) -> bool:
    """Byte-for-byte the same steps (a resent spool file is), and events of the same steps
    and kinds. `row` is the new batch raw; `kept` is compared decoded, so a batch stored
    in an earlier storage format or codec layout is still recognised when resent."""
    columns = _STEP_COLUMNS + (_LAYER_COLUMNS if kept.n_layers == row["n_layers"] else ())
    return (_event_keys(kept.events) == _event_keys(row["events"])
            and all(_raw(kept, c) == _plain(row[c]) for c in columns))


def _raw(kept, column: str):
    """A stored batch column as `storage.new_batch_row` packs it (uncompressed)."""
    value = _plain(getattr(kept, column))
    if value is None or column not in ITEMSIZE or kept.format != COMPRESSED_FORMAT:
        return value
    return decode_column(value, ITEMSIZE[column])


def _event_keys(events: list[dict] | None) -> list[tuple]:
    """Events by step and kind: the server adds to a restart's detail when it stores it."""
    return [(e.get("step"), e.get("kind")) for e in events or []]


def _plain(value):
    return bytes(value) if isinstance(value, memoryview) else value


def _unique_step_delta(session: Session, run_id: str, rank: int, seq: int, first: int,
                       last: int) -> tuple[int, int]:
    """Steps and skipped steps that the batch `seq` (already flushed) adds to the rank,
    counting a step sent twice once: the rank's steps in [first, last] as reads see them
    (`concat`, in `load_batches` order), with the new batch and without. Reads only the
    batches that overlap it, and only on the rare overlapping batch (a resumed run)."""
    rows = session.execute(
        select(Batch.seq, Batch.n_steps, Batch.n_layers, Batch.format, Batch.scalars,
               Batch.present, Batch.events, Batch.superseded_from)
        .where(Batch.run_id == run_id, Batch.rank == rank, Batch.last_step >= first,
               Batch.first_step <= last)
        .order_by(Batch.first_step, Batch.seq)
    ).all()
    parts = [(r.seq, unpack_row(r, 0, with_layers=False, with_acts=False)) for r in rows]
    with_new = clip_steps(concat([p for _, p in parts], 0), first, last)
    without = clip_steps(concat([p for s, p in parts if s != seq], 0), first, last)
    return (len(with_new) - len(without),
            int(with_new.skipped.sum()) - int(without.skipped.sum()))


def _add_counts(rank_row: RunRank, batch: BatchIn, series: StepSeries, new_steps: int,
                new_skipped: int) -> None:
    rank_row.batches += 1
    rank_row.max_seq = max(rank_row.max_seq, batch.seq)
    rank_row.steps += new_steps
    rank_row.skipped += new_skipped
    rank_row.dropped_batches = max(rank_row.dropped_batches, batch.dropped_batches)
    rank_row.dropped_steps = max(rank_row.dropped_steps, batch.dropped_steps)
    if not len(series):
        return
    last = int(series.steps[-1])
    if rank_row.last_step is None or last >= rank_row.last_step:
        rank_row.last_step = last
        scale = _last_finite(series, "scale_after")
        if scale is None:
            scale = _last_finite(series, "loss_scale")
        if scale is not None:
            rank_row.loss_scale = scale


def _last_finite(series, name: str) -> float | None:
    i = FIELD_INDEX[name]
    col = series.scalars[:, i]
    ok = series.present[:, i] & np.isfinite(col)
    return float(col[ok][-1]) if ok.any() else None

