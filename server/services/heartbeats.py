"""The agent's heartbeat between batches (`reached_step`: the last step its training loop
closed), so a killed run tells the steps that never arrived. The value only rises, so one
forged heartbeat would stand for good: a step beyond what the rank could have trained
since its last stored batch is refused (docs/security.md)."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ampwatch.server.db import writing
from ampwatch.server.errors import InvalidInput, NotFound
from ampwatch.server.models import Batch, RunRank, as_utc, utcnow

# steps a rank may be ahead of its last stored one whatever its rate: a young run, a fast
# loop between a batch and its heartbeat
HEARTBEAT_MIN_AHEAD = 10_000
# how much faster than its stored batches show a rank may have trained since the last one
HEARTBEAT_RATE_FACTOR = 10
# steps a second taken for a rank with one batch, or slower batches than this
HEARTBEAT_MIN_RATE = 100.0


def plausible_step(session: Session, rank_row: RunRank) -> int:
    """The highest step a rank could have reached by now: its last stored step, plus
    HEARTBEAT_MIN_AHEAD, plus HEARTBEAT_RATE_FACTOR x its step rate (steps between its
    first and last batch over the time between their arrival, at least
    HEARTBEAT_MIN_RATE) x the time since its last batch arrived. Two indexed reads."""
    def batch(newest: bool):
        order = Batch.seq.desc() if newest else Batch.seq
        return session.execute(
            select(Batch.received_at, Batch.last_step)
            .where(Batch.run_id == rank_row.run_id, Batch.rank == rank_row.rank)
            .order_by(order).limit(1)).first()

    first, last = batch(newest=False), batch(newest=True)
    stored = rank_row.last_step or 0
    if first is None or last is None:
        return stored + HEARTBEAT_MIN_AHEAD
    span = (as_utc(last.received_at) - as_utc(first.received_at)).total_seconds()
    rate = (last.last_step - first.last_step) / span if span > 0 else 0.0
    since = max((utcnow() - as_utc(last.received_at)).total_seconds(), 0.0)
    return int(stored + HEARTBEAT_MIN_AHEAD
               + HEARTBEAT_RATE_FACTOR * max(rate, HEARTBEAT_MIN_RATE) * since)


def note_reached_step(session: Session, run_id: str, rank: int, reached_step: int) -> None:
    """Keep the highest step a rank's training loop says it reached. NotFound before the
    rank's first batch; InvalidInput (nothing stored) beyond `plausible_step`. Touches
    neither `last_seen_at` nor the steps."""
    with writing(session):
        rank_row = session.get(RunRank, (run_id, rank))
        if rank_row is None:
            raise NotFound(f"run {run_id!r} has no rank {rank} yet: send a batch first")
        most = plausible_step(session, rank_row)
        if reached_step > most:
            raise InvalidInput(f"reached_step {reached_step} is beyond what rank {rank} can "
                               f"have trained since its last batch arrived (at most {most})")
        session.execute(
            update(RunRank)
            .where(RunRank.run_id == run_id, RunRank.rank == rank,
                   (RunRank.reached_step.is_(None)) | (RunRank.reached_step < reached_step))
            .values(reached_step=reached_step))
        session.commit()
