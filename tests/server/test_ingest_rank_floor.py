"""Ingest's share of the rank comparison costs the same at any rank count: a batch reads
the two lowest last steps from an index and counts the run's ranks only when its rank was
below all the others, about once per round of batches (server/services/ingest.py:
_all_ranks_through). Truth is the test's own schedule: ranks send
round by round, so the step every rank has sent through advances exactly once per round,
on the round's last batch, to that round's last step."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from ampwatch.server.models import AnalysisTask
from tests.utils import make_steps, post_batch, register_run

N_LAYERS, PER_BATCH = 4, 5


def test_the_rank_floor_is_read_once_per_round_and_advances_with_it(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    ranks, rounds = 24, 4
    # no worker: the queue keeps every task as ingest wrote it
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}",
                              embedded_worker=False))
    aggregates: list[int] = []

    def after(conn, cursor, statement, parameters, context, executemany) -> None:
        if "count(run_ranks.last_step)" in statement:
            aggregates.append(current_round)

    with TestClient(app) as api:
        register_run(api, "floor", n_layers=N_LAYERS,
                     environment={"world_size": ranks, "grad_layout": "replicated"})
        event.listen(app.state.engine, "after_cursor_execute", after)
        for current_round in range(rounds):
            for rank in range(ranks):
                steps = make_steps(current_round * PER_BATCH, PER_BATCH, N_LAYERS)
                assert post_batch(api, "floor", current_round, steps, rank=rank).status_code == 200
        event.remove(app.state.engine, "after_cursor_execute", after)
        with Session(app.state.engine) as session:
            tasks = session.execute(select(AnalysisTask.rank, AnalysisTask.seq,
                                           AnalysisTask.ranks_through)
                                    .order_by(AnalysisTask.id)).all()
    close_app(app)

    # round 0: every rank's first batch but the first rank's (no other rank had a step
    # then) counts them; later rounds: only the round's last rank, left below the others
    assert aggregates == [0] * (ranks - 1) + [r for r in range(1, rounds)]
    advanced = [(t.rank, t.seq, t.ranks_through) for t in tasks if t.ranks_through is not None]
    assert advanced == [(ranks - 1, r, (r + 1) * PER_BATCH - 1) for r in range(rounds)]
