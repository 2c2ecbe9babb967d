"""Restarts from a checkpoint: a rank that sends again steps it already sent (a job that
crashed at step 5,300 and resumed from its checkpoint at 5,000) supersedes the stored
copies from that step on. The earlier batches keep their bytes, marked with
`superseded_from`, and reads leave those steps out (storage.unpack_row); the rank's
totals and its step-bucket summaries drop them; the restart batch carries a `restart`
event, so the history shows it.

The rule, per (run, rank): a new batch (a seq above every stored one) whose first step
is not after the last step stored for the rank is a restart at that step. Every batch
already stored arrived before it, so their copies of the steps from there on are the
older ones. (An agent that got 409 for a used seq resends under the next free seq, so seq
order is not always arrival order; a batch replayed late from an old spool carries a seq
below the stored ones and restarts nothing.)
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from ampwatch.server.models import Batch, Run, RunRank, StepSummary
from ampwatch.server.storage import load_series, unpack_row
from ampwatch.server.summaries import SUMMARY_STEPS, fold_batch

RESTART_EVENT = "restart"


def stored_extent(session: Session, run_id: str, rank: int) -> tuple[int | None, int]:
    """(last step, highest seq) stored for the rank; (None, -1) when it has none."""
    row = session.execute(select(RunRank.last_step, RunRank.max_seq).where(
        RunRank.run_id == run_id, RunRank.rank == rank)).first()
    return (None, -1) if row is None else (row.last_step, row.max_seq)


def restart_from(last_step: int | None, max_seq: int, seq: int, first_step: int
                 ) -> int | None:
    """The step a batch (`seq`, starting at `first_step`) restarts from, or None when it
    continues after `last_step`, the last one the rank has stored, or is not new."""
    if last_step is None or seq <= max_seq or not 0 <= first_step <= last_step:
        return None
    return first_step


def supersede(session: Session, run_id: str, rank: int, from_step: int) -> tuple[int, int]:
    """Mark the steps from `from_step` on of the rank's stored batches as superseded.
    Returns (steps, skipped steps) that left the stored history. Reads the step columns
    of the batches concerned once (a restart is rare)."""
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
        _rebuild_summaries(session, run_id, rank, from_step)
    return steps, skipped


def _rebuild_summaries(session: Session, run_id: str, rank: int, from_step: int) -> None:
    """Step-bucket summaries from `from_step`'s bucket on held superseded steps: drop them
    and fold that bucket's remaining steps (before `from_step`) in again."""
    bucket = from_step // SUMMARY_STEPS
    session.execute(delete(StepSummary).where(StepSummary.run_id == run_id,
                                              StepSummary.rank == rank,
                                              StepSummary.bucket >= bucket))
    start = bucket * SUMMARY_STEPS
    if start < from_step:
        n_layers = session.scalar(select(Run.n_layers).where(Run.id == run_id))
        fold_batch(session, run_id, rank, load_series(session, run_id, rank, start,
                                                      from_step - 1, n_layers=n_layers))
