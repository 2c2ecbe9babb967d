"""Restarts from a checkpoint: a rank that sends again steps it already sent (a job that
crashed at step 5,300 and resumed from its checkpoint at 5,000) supersedes the stored
copies from that step on. The earlier batches keep their bytes, marked with
`superseded_from`, and reads leave those steps out (storage.unpack_row); the rank's
totals drop them; the restart batch carries a `restart` event, so the history shows it.

The rule, per (run, rank): a batch whose first step is not after the last step stored
for the rank is a restart at that step; batches are sent in seq order, so every stored
batch with a lower seq is older.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from ampwatch.server.models import Batch, RunRank
from ampwatch.server.storage import unpack_row

RESTART_EVENT = "restart"


def stored_last_step(session: Session, run_id: str, rank: int) -> int | None:
    return session.scalar(select(RunRank.last_step).where(RunRank.run_id == run_id,
                                                          RunRank.rank == rank))


def restart_from(last_step: int | None, first_step: int) -> int | None:
    """The step a batch starting at `first_step` restarts from, or None when it continues
    after `last_step`, the last one the rank has stored."""
    return first_step if last_step is not None and 0 <= first_step <= last_step else None


def supersede(session: Session, run_id: str, rank: int, seq: int, from_step: int
              ) -> tuple[int, int]:
    """Mark the steps from `from_step` on of the rank's batches before `seq` as
    superseded. Returns (steps, skipped steps) that left the stored history. Reads the
    step columns of the batches concerned once (a restart is rare)."""
    overlapping = (Batch.run_id == run_id, Batch.rank == rank, Batch.seq < seq,
                   Batch.last_step >= from_step,
                   or_(Batch.superseded_from.is_(None), Batch.superseded_from > from_step))
    rows = session.execute(select(Batch.n_steps, Batch.n_layers, Batch.scalars, Batch.present,
                                  Batch.superseded_from).where(*overlapping)).all()
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
    return steps, skipped
