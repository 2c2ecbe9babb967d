"""The combined grad norms of a sharded run read in bounded pieces: a span of steps at a
time (`limit`, continued by `next_start`) and a chunk of ranks at a time (ShardSums), with
the same answer as the whole read and as the test's own sums of the norms it sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ampwatch.server.services import ranks as ranks_module
from tests.utils import make_steps, post_batch, register_run

N_RANKS, N_LAYERS, PER_BATCH, BATCHES = 5, 3, 10, 4
MISSING_STEP = (3, 17)  # (rank, step) the rank never sent: no combined value for it


def sent_norms(rank: int, step: int) -> tuple[float, list[float]]:
    """What rank `rank` reports for `step`: its shard's total and per-layer norms."""
    rng = np.random.default_rng(1000 * rank + step)
    layers = rng.uniform(0.1, 2.0, N_LAYERS)
    return float(rng.uniform(0.5, 3.0)), [float(v) for v in layers]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from fastapi.testclient import TestClient

    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    path = Path(tmp_path_factory.mktemp("combined"), "ampwatch.db")
    app = create_app(Settings(database_url=f"sqlite:///{path}"))
    with TestClient(app) as client:
        register_run(client, "fsdp", n_layers=N_LAYERS,
                     environment={"world_size": N_RANKS, "grad_layout": "sharded"})
        for seq in range(BATCHES):
            for rank in range(N_RANKS):
                steps = []
                for step in make_steps(seq * PER_BATCH, PER_BATCH, N_LAYERS):
                    if (rank, step["step"]) == MISSING_STEP:
                        continue
                    step["grad_norm"], step["layer_grad_norm"] = sent_norms(rank, step["step"])
                    steps.append(step)
                assert post_batch(client, "fsdp", seq, steps, rank=rank).status_code == 200
        yield client
    close_app(app)


def truth() -> tuple[list[int], list[float], list[list[float]]]:
    steps = [s for s in range(BATCHES * PER_BATCH) if s != MISSING_STEP[1]]
    totals, layers = [], []
    for s in steps:
        parts = [sent_norms(r, s) for r in range(N_RANKS)]
        totals.append(float(np.sqrt(sum(t * t for t, _ in parts))))
        layers.append(list(np.sqrt(np.sum(np.square([ls for _, ls in parts]), axis=0))))
    return steps, totals, layers


def read_all(api, **params) -> tuple[list[int], list, list, int]:
    steps, totals, layers, pages, start = [], [], [], 0, None
    while True:
        query = {"layers": "true", **params, **({"start": start} if start is not None else {})}
        body = api.get("/api/v1/runs/fsdp/grad_norms", params=query).json()
        steps += body["steps"]
        totals += body["grad_norm"]
        layers += body["layer_grad_norm"]
        pages += 1
        if (start := body["next_start"]) is None:
            return steps, totals, layers, pages


def test_the_whole_read_is_the_ranks_summed_squares_on_steps_every_rank_sent(api):
    steps, totals, layers, pages = read_all(api)
    want_steps, want_totals, want_layers = truth()
    assert pages == 1 and steps == want_steps
    assert np.allclose(totals, want_totals, rtol=1e-6)
    assert np.allclose(layers, want_layers, rtol=1e-6)


def test_spans_of_limit_steps_continue_to_the_same_answer(api):
    steps, totals, layers, pages = read_all(api, limit=7)
    want_steps, want_totals, want_layers = truth()
    assert pages == 6  # steps 0..39, 7 step numbers a read
    assert steps == want_steps
    assert np.allclose(totals, want_totals, rtol=1e-6)
    assert np.allclose(layers, want_layers, rtol=1e-6)


def test_ranks_read_a_chunk_at_a_time_give_the_same_answer(api, monkeypatch):
    # a budget this small reads 3 ranks a chunk and 15 steps a span
    span_steps = BATCHES * PER_BATCH + 2 * PER_BATCH
    monkeypatch.setattr(ranks_module, "COMBINED_VALUES", 2 * span_steps * N_LAYERS)
    steps, totals, layers, pages = read_all(api)
    want_steps, want_totals, want_layers = truth()
    assert steps == want_steps and pages > 1
    assert np.allclose(totals, want_totals, rtol=1e-6)
    assert np.allclose(layers, want_layers, rtol=1e-6)
