"""Ranks of one run never wait for each other on Postgres: with rank 0's batch held just
before its COMMIT (every lock it took still held), other ranks of the same run commit.
Before issue 31 every batch first updated the run's row, so this waited on rank 0."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import event, text

from ampwatch.server.app import close_app, create_app
from ampwatch.server.schemas.batches import BatchIn
from ampwatch.server.schemas.runs import RunUpsert
from ampwatch.server.services.ingest import ingest_batch
from ampwatch.server.services.runs import upsert_run
from ampwatch.server.settings import Settings
from tests.conftest import fresh_database_url
from tests.utils import make_layers, make_steps

N_LAYERS = 4
WAIT_S = 3  # longer than any batch here takes; a lock wait would reach it
pytestmark = pytest.mark.postgres


@pytest.fixture
def maker(request, tmp_path):
    app = create_app(Settings(database_url=fresh_database_url(request, "postgres", tmp_path)))
    yield app.state.sessionmaker
    close_app(app)


def register(maker, run_id: str) -> None:
    with maker() as session:
        upsert_run(session, run_id, RunUpsert(name=run_id, layers=make_layers(N_LAYERS),
                                              environment={"world_size": 3}), Settings())


def batch(rank: int, seq: int) -> BatchIn:
    return BatchIn.model_validate({"rank": rank, "seq": seq,
                                   "steps": make_steps(seq * 5, 5, N_LAYERS)})


def test_a_rank_held_before_commit_blocks_no_other_rank(maker):
    register(maker, "wide")
    with maker() as session:  # rank 0 has a row already: its second batch updates it
        ingest_batch(session, "wide", batch(0, 0), Settings())
    at_commit, release = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def hold_rank_0() -> None:
        with maker() as session:
            def before_commit(_session) -> None:
                at_commit.set()
                release.wait(30)

            event.listen(session, "before_commit", before_commit)
            try:
                ingest_batch(session, "wide", batch(0, 1), Settings())
            except BaseException as exc:  # reported to the test thread below
                failures.append(exc)

    holder = threading.Thread(target=hold_rank_0)
    holder.start()
    try:
        assert at_commit.wait(30), "rank 0's batch never reached its commit"
        started = time.monotonic()
        # rank 1: a first batch (its row is made) and a second (its row is updated);
        # rank 2: a first batch; then a PUT. A lock wait fails at lock_timeout instead of hanging.
        for rank, seq in ((1, 0), (1, 1), (2, 0)):
            with maker() as session:
                session.execute(text(f"SET LOCAL lock_timeout = '{WAIT_S}s'"))
                ack = ingest_batch(session, "wide", batch(rank, seq), Settings())
                assert ack.stored_steps == 5 and not ack.duplicate
        with maker() as session:  # an agent registering again (PUT) does not wait either
            session.execute(text(f"SET LOCAL lock_timeout = '{WAIT_S}s'"))
            upsert_run(session, "wide", RunUpsert(tags=["again"]), Settings())
        took = time.monotonic() - started
        assert holder.is_alive(), "rank 0 committed before the others were tested"
    finally:
        release.set()
        holder.join(30)
    assert not failures, failures
    print(f"with rank 0 held before COMMIT: 3 batches of ranks 1 and 2 and a PUT of the "
          f"run committed in {took * 1000:.0f} ms")
    assert took < WAIT_S
    with maker() as session:
        waiting = session.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"))
        ranks = dict(session.execute(text(
            "SELECT rank, steps FROM run_ranks WHERE run_id = 'wide' ORDER BY rank")).all())
    assert waiting == 0
    assert ranks == {0: 10, 1: 10, 2: 5}
