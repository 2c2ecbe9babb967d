"""The worker's combined grad norms of a sharded run (server/store/combined.py): a read takes the
summed squares from a few bucket rows, not every rank's batches, and answers exactly what
the test's own sums of the norms it sent call for, through restarts, late batches and
ranks the worker never folded."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete

from ampwatch.server.app import close_app, create_app
from ampwatch.server.models import CombinedRank
from ampwatch.server.services import ranks as ranks_module
from ampwatch.server.settings import Settings
from ampwatch.server.worker.analysis_worker import AnalysisWorker
from tests.conftest import judged_client
from tests.utils import make_steps, register_run

N_RANKS, N_LAYERS, PER_BATCH = 4, 3, 10
WIRE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class Truth:
    """What each rank sent for each step, as reads see it (a restart replaces)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], float | None] = {}

    def combined(self) -> tuple[list[int], list[float | None]]:
        steps = sorted({s for _, s in self.sent})
        keep, totals = [], []
        for step in steps:
            values = [self.sent[(r, step)] for r in range(N_RANKS) if (r, step) in self.sent]
            if len(values) < N_RANKS:
                continue  # a step needs every rank's shard
            keep.append(step)
            totals.append(None if None in values else math.sqrt(sum(v * v for v in values)))
        return keep, totals


def norm(rank: int, step: int, restarted: bool = False) -> float:
    return 0.5 + rank + step / 100 + (7.0 if restarted else 0.0)


@pytest.fixture
def served(database_url: str):
    """(a client on the app that judges before it answers, the app)"""
    app = create_app(Settings(database_url=database_url))
    with judged_client(app) as client:
        register_run(client, "fsdp", n_layers=N_LAYERS,
                     environment={"world_size": N_RANKS, "grad_layout": "sharded"})
        yield client, app
    close_app(app)


def send(api, truth: Truth, rank: int, seq: int, first: int, *, restarted: bool = False,
         events: list | None = None, odd: dict | None = None) -> None:
    """One batch of PER_BATCH steps from `first`; `odd` maps a step to the norm sent
    instead (None: no total sent)."""
    steps = make_steps(first, PER_BATCH, N_LAYERS)
    for step in steps:
        value = norm(rank, step["step"], restarted)
        if odd and step["step"] in odd:
            value = odd[step["step"]]
        if value is None:
            del step["grad_norm"]
        else:
            step["grad_norm"] = "Infinity" if value == math.inf else value
        truth.sent[(rank, step["step"])] = value
    body = {"rank": rank, "seq": seq, "steps": steps, "events": events or []}
    response = api.post("/api/v1/runs/fsdp/batches", json=body)
    assert response.status_code == 200, response.text


def read(api, monkeypatch) -> tuple[list[int], list[float | None], list[tuple]]:
    """The combined norms (no layers), and the spans of steps the read took from the
    ranks' batches (a spy on the batch read: it still reads)."""
    spans: list[tuple[int, int]] = []
    batch_read = ranks_module.load_ranks_series

    def spied(session, run_id, ranks, start=None, end=None, **kw):
        spans.append((start, end))
        return batch_read(session, run_id, ranks, start, end, **kw)

    monkeypatch.setattr(ranks_module, "load_ranks_series", spied)
    body = api.get("/api/v1/runs/fsdp/grad_norms").json()
    monkeypatch.setattr(ranks_module, "load_ranks_series", batch_read)
    totals = [WIRE.get(v, v) for v in body["grad_norm"]]
    return body["steps"], totals, spans


def assert_same(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), (got, want)
        if w is not None:
            assert g == pytest.approx(w, rel=1e-9)


def test_appending_ranks_are_read_from_the_buckets_alone(served, monkeypatch) -> None:
    api, app = served
    truth = Truth()
    for seq in range(4):  # steps 0..39, across the rollup's bucket of 1,000 steps
        for rank in range(N_RANKS):
            odd = {}
            if (rank, seq) == (1, 1):
                odd = {13: math.inf}  # an overflow: the combined norm is inf
            if (rank, seq) == (3, 2):
                odd = {21: None}  # no total from one rank: the combined one is unknown
            send(api, truth, rank, seq, seq * PER_BATCH, odd=odd)
    # rank 2 never sends steps 40..49: they are no combined step
    for rank in (0, 1, 3):
        send(api, truth, rank, 4, 40)
    steps, totals, spans = read(api, monkeypatch)
    want_steps, want_totals = truth.combined()
    assert steps == want_steps == list(range(40))
    assert_same(totals, want_totals)
    assert totals[13] == math.inf and totals[21] is None
    assert spans == []  # no batch read


def test_a_restart_and_a_late_batch_are_read_from_the_batches_after_them(
        served, monkeypatch) -> None:
    api, app = served
    truth = Truth()
    for seq in range(3):
        for rank in range(N_RANKS):
            send(api, truth, rank, seq, seq * PER_BATCH)
    # rank 0 crashed after step 29 and resumed from 15: steps 15.. are sent again
    send(api, truth, 0, 3, 15, restarted=True,
         events=[{"step": 15, "kind": "restart", "detail": {}}])
    send(api, truth, 0, 4, 25, restarted=True)
    send(api, truth, 0, 5, 35, restarted=True)
    # rank 1's batch of steps 40.. arrives before the one of steps 30..
    send(api, truth, 1, 4, 40)
    send(api, truth, 1, 3, 30)
    for rank in (2, 3):
        send(api, truth, rank, 3, 30)
        send(api, truth, rank, 4, 40)
    steps, totals, spans = read(api, monkeypatch)
    want_steps, want_totals = truth.combined()
    assert steps == want_steps == list(range(45))
    assert_same(totals, want_totals)
    assert totals[20] == pytest.approx(math.sqrt(sum(
        norm(r, 20, restarted=r == 0) ** 2 for r in range(N_RANKS))))
    assert spans == [(15, 44)]  # batches only after step 14, where rank 0 stopped


def test_a_rank_the_worker_never_folded_keeps_every_read_on_the_batches(
        served, monkeypatch) -> None:
    api, app = served
    truth = Truth()
    for seq in range(2):
        for rank in range(N_RANKS):
            send(api, truth, rank, seq, seq * PER_BATCH)
    # as a database from before the rollup: rank 2 has no row, and gets none
    with app.state.sessionmaker() as session:
        session.execute(delete(CombinedRank).where(CombinedRank.rank == 2))
        session.commit()
    for rank in range(N_RANKS):
        send(api, truth, rank, 2, 20)
    steps, totals, spans = read(api, monkeypatch)
    want_steps, want_totals = truth.combined()
    assert steps == want_steps == list(range(30))
    assert_same(totals, want_totals)
    assert spans == [(0, 29)]  # every step from the batches
    with app.state.sessionmaker() as session:
        assert session.get(CombinedRank, ("fsdp", 2)) is None


def test_one_claim_of_every_batch_folds_as_batches_judged_one_at_a_time(
        database_url: str, monkeypatch) -> None:
    """Nothing judges while the batches arrive; then one worker claim takes them all
    (several ranks' shares of a step, several batches of a rank, a restart among them)."""
    app = create_app(Settings(database_url=database_url, embedded_worker=False,
                              analysis_wait_s=0))
    try:
        with TestClient(app, base_url="http://127.0.0.1") as api:
            register_run(api, "fsdp", n_layers=N_LAYERS,
                         environment={"world_size": N_RANKS, "grad_layout": "sharded"})
            truth = Truth()
            for seq in range(3):
                for rank in range(N_RANKS):
                    send(api, truth, rank, seq, seq * PER_BATCH)
            send(api, truth, 3, 3, 12, restarted=True,
                 events=[{"step": 12, "kind": "restart", "detail": {}}])
            for rank in range(3):
                send(api, truth, rank, 3, 30)
            send(api, truth, 3, 4, 22, restarted=True)
            send(api, truth, 3, 5, 32, restarted=True)
            worker = AnalysisWorker(app.state.sessionmaker, app.state.settings,
                                    claim_size=64)
            assert worker.drain() == 3 * N_RANKS + 6 and worker.claims == 1
            steps, totals, spans = read(api, monkeypatch)
        want_steps, want_totals = truth.combined()
        assert steps == want_steps == list(range(40))
        assert_same(totals, want_totals)
        assert spans == [(12, 39)]  # rank 3 stopped being folded at its restart
    finally:
        close_app(app)
