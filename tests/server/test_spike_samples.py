"""Spike samples: what the agent sends under `spikes` is stored, read back exactly (null
as not measured), checked against the layer table, folded into the layers page's
heatmap matrix, superseded by a restart and dropped by archiving. SQLite and Postgres."""

from __future__ import annotations

import numpy as np
from sqlalchemy import func, select

from ampwatch.server.models import SpikeSample
from ampwatch.server.store.spike_samples import SIGNALS, load_spike_window
from tests.utils import make_steps, post_batch, register_run

N = 4


def with_spikes(steps: list[dict], every: int = 2) -> list[dict]:
    """Sampled steps carry an update ratio per layer, and layer 1's attention logit."""
    for s in steps:
        if s["step"] % every == 0:
            s["spikes"] = {"update_ratio": [1e-3 * (i + 1) + s["step"] * 1e-6 for i in range(N)],
                           "attn_max_logit": [None, 2.0 + s["step"], None, None]}
    return steps


def test_sampled_signals_are_stored_and_read_back(api, app) -> None:
    register_run(api, "spk", n_layers=N)
    assert post_batch(api, "spk", 0, with_spikes(make_steps(0, 10, N))).status_code == 200
    with app.state.sessionmaker() as session:
        window = load_spike_window(session, "spk", 0, N)
    assert window.steps.tolist() == [0, 2, 4, 6, 8]
    ratio = window.signal("update_ratio")
    assert np.allclose(ratio[1], [1e-3 * (i + 1) + 2e-6 for i in range(N)], rtol=1e-6)
    logit = window.signal("attn_max_logit")
    assert np.isnan(logit[:, [0, 2, 3]]).all() and logit[:, 1].tolist() == [2, 4, 6, 8, 10]
    assert np.isnan(window.signal("logit_lse")).all()
    assert set(SIGNALS) >= {"update_ratio", "attn_max_logit", "logit_lse"}


def test_a_vector_of_the_wrong_length_is_refused(api) -> None:
    register_run(api, "spk-bad", n_layers=N)
    steps = make_steps(0, 1, N)
    steps[0]["spikes"] = {"update_ratio": [1.0] * (N + 1)}
    answer = post_batch(api, "spk-bad", 0, steps)
    assert answer.status_code == 422
    assert "spikes.update_ratio has 5 entries" in answer.text


def test_the_heatmap_matrix_reads_a_signal_per_layer(api) -> None:
    register_run(api, "spk-matrix", n_layers=N)
    post_batch(api, "spk-matrix", 0, with_spikes(make_steps(0, 10, N)))
    answer = api.get("/api/v1/runs/spk-matrix/layers/matrix",
                     params={"metric": "attn_max_logit", "buckets": 5})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["metric"] == "attn_max_logit" and len(body["layers"]) == N
    assert body["step_start"] == [0, 2, 4, 6, 8]
    assert body["values"][1] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert body["values"][0] == [None] * 5
    folded = api.get("/api/v1/runs/spk-matrix/layers/matrix",
                     params={"metric": "update_ratio", "buckets": 2}).json()
    assert len(folded["step_start"]) == 2  # the largest value of each bucket
    assert np.isclose(folded["values"][3][1], 4e-3 + 8e-6)


def test_archiving_drops_the_samples(api, app) -> None:
    register_run(api, "spk-archive", n_layers=N)
    post_batch(api, "spk-archive", 0, with_spikes(make_steps(0, 10, N)))
    assert api.post("/api/v1/runs/spk-archive/archive").status_code == 200
    with app.state.sessionmaker() as session:
        assert session.scalar(select(func.count()).select_from(SpikeSample)) == 0
