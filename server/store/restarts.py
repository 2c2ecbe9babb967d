"""Restarts from a checkpoint: a job that crashed at step 5,300 and resumed from its
checkpoint at 5,000 sends steps 5,000 on again; they supersede the stored copies. The
earlier batches keep their bytes, marked with `superseded_from`, and reads leave those
steps out (storage.unpack_row); the rank's totals and its step-bucket summaries drop them.

The rule, per (run, rank): a batch carrying a `restart` event at step S (the agent sends
one in its first batch when it resumes a run with the trainer's step, `attach(...,
resume=True, step=S)`) supersedes every stored copy of steps S and later: each stored
batch arrived before it. The event stays in the history, with what it superseded, and
the findings that the superseded steps raised go with them. Only
that explicit event restarts: steps that merely arrive out of order (an agent moving a
batch after a 409, a late replay from an old spool) supersede nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from sqlalchemy import case, delete, func, or_, select, update
from sqlalchemy.orm import Session

from ampwatch.server.models import (
    Batch,
    Finding,
    Fp8Sample,
    Run,
    RunRank,
    SpikeSample,
    StepSummary,
)
from ampwatch.server.store.storage import load_series, unpack_row
from ampwatch.server.store.summaries import SUMMARY_STEPS, fold_batch
from ampwatch.wire import RESTART_EVENT


def restart_from(events: list[dict]) -> dict | None:
    """The batch's `restart` event (the earliest, if several), or None."""
    restarts = [e for e in events if e.get("kind") == RESTART_EVENT
                and isinstance(e.get("step"), int)]
    return min(restarts, key=lambda e: e["step"]) if restarts else None


def stored_last_step(session: Session, run_id: str, rank: int) -> int | None:
    return session.scalar(select(RunRank.last_step).where(RunRank.run_id == run_id,
                                                          RunRank.rank == rank))


def supersede(session: Session, run_id: str, rank: int, from_step: int) -> tuple[int, int]:
    """Mark the steps from `from_step` on of the rank's stored batches as superseded and
    delete their FP8 samples (the re-done steps send their own). Returns (steps, skipped
    steps) that left the stored history. Reads the step columns of the batches concerned
    once (a restart is rare)."""
    session.execute(delete(Fp8Sample).where(Fp8Sample.run_id == run_id, Fp8Sample.rank == rank,
                                            Fp8Sample.step >= from_step))
    session.execute(delete(SpikeSample).where(SpikeSample.run_id == run_id,
                                              SpikeSample.rank == rank,
                                              SpikeSample.step >= from_step))
    overlapping = (Batch.run_id == run_id, Batch.rank == rank, Batch.last_step >= from_step,
                   or_(Batch.superseded_from.is_(None), Batch.superseded_from > from_step))
    rows = session.execute(select(Batch.n_steps, Batch.n_layers, Batch.format, Batch.scalars,
                                  Batch.present, Batch.superseded_from)
                           .where(*overlapping)).all()
    steps = skipped = 0
    for row in rows:
        whole = SimpleNamespace(**{**row._asdict(), "events": None, "superseded_from": None})
        series = unpack_row(whole, row.n_layers, with_layers=False, with_acts=False)
        numbers = series.steps
        leaving = (numbers >= from_step) & (
            numbers < row.superseded_from if row.superseded_from is not None else True)
        steps += int(leaving.sum())
        skipped += int(np.asarray(series.skipped)[leaving].sum())
    if rows:
        session.execute(update(Batch).where(*overlapping).values(superseded_from=from_step))
        rebuild_summaries(session, run_id, rank, from_step)
    return steps, skipped


def forget_findings(session: Session, run_id: str, rank: int, from_step: int) -> bool:
    """After a restart from `from_step`: delete the rank's findings that superseded steps
    raised (first seen at or after it) and cut back those that ran into it, so no finding
    speaks of data that reads no longer see; the analysis of the re-done steps updates
    the rest. Returns whether any finding changed (the run's health must be recounted)."""
    mine = (Finding.run_id == run_id, Finding.rank == rank)
    gone = session.execute(delete(Finding).where(*mine, Finding.step >= from_step)).rowcount
    cut = session.execute(
        update(Finding).where(*mine, Finding.step < from_step, Finding.last_step >= from_step)
        .values(last_step=from_step - 1)
    ).rowcount
    return bool(gone or cut)


# steps read at once while rebuilding: 10,000 steps of 1,000 layers are about 40 MB of norms
REBUILD_CHUNK_STEPS = 10 * SUMMARY_STEPS


def rebuild_summaries(session: Session, run_id: str, rank: int, from_step: int = 0,
                      through_step: int | None = None) -> None:
    """Drop the rank's step-bucket summaries from `from_step`'s bucket on (through
    `through_step`'s bucket, when given) and fold the stored steps of those buckets into
    them again. After a restart (its steps from `from_step` on already superseded) that
    refolds the bucket's earlier steps; from 0 it builds a run's summaries afresh (one
    stored before summaries existed); over a batch's steps it counts a step sent twice
    once, as reads see it. Reads the batches REBUILD_CHUNK_STEPS step numbers at a time,
    so memory does not grow with the run's length."""
    bucket = from_step // SUMMARY_STEPS
    mine_summaries = [StepSummary.run_id == run_id, StepSummary.rank == rank,
                      StepSummary.bucket >= bucket]
    if through_step is not None:
        mine_summaries.append(StepSummary.bucket <= through_step // SUMMARY_STEPS)
    session.execute(delete(StepSummary).where(*mine_summaries))
    n_layers = session.scalar(select(Run.n_layers).where(Run.id == run_id))
    # a batch's last step that reads still see (a restart superseded the later ones)
    readable_last = case((Batch.superseded_from.is_(None), Batch.last_step),
                         else_=Batch.superseded_from - 1)
    mine = (Batch.run_id == run_id, Batch.rank == rank)
    last = session.scalar(select(func.max(readable_last)).where(*mine))
    if last is not None and through_step is not None:
        last = min(last, (through_step // SUMMARY_STEPS + 1) * SUMMARY_STEPS - 1)
    start = bucket * SUMMARY_STEPS
    while last is not None and start <= last:
        first = session.scalar(select(func.min(Batch.first_step)).where(
            *mine, readable_last >= start))
        if first is None:
            return
        start = max(start, first // SUMMARY_STEPS * SUMMARY_STEPS)  # skip gaps in step numbers
        end = min(start + REBUILD_CHUNK_STEPS - 1, last)  # superseded steps are not read
        fold_batch(session, run_id, rank, load_series(session, run_id, rank, start, end,
                                                      n_layers=n_layers))
        start = end + 1
