"""FP8 samples: stored as their FP8 layers' columns, compressed; rows stored whole by
older servers still read; the report folds samples into step buckets as it reads them.
SQLite and Postgres."""

from __future__ import annotations

import math

import numpy as np
from sqlalchemy import func, select, update

from ampwatch.server.models import Fp8Sample
from ampwatch.server.store import fp8_samples
from ampwatch.server.store.fp8_samples import ROLES, STATS, load_fp8_window
from tests.utils import make_layers, make_steps, post_batch, register_run

FP8 = {"fp8_recipe": "delayed (amax history 16)", "fp8_input_format": "e4m3",
       "fp8_weight_format": "e4m3", "fp8_grad_format": "e5m2"}


def layers(n: int, fp8_every: int) -> list[dict]:
    """n layers, every `fp8_every`-th of them an FP8 layer."""
    table = make_layers(n)
    for layer in table[::fp8_every]:
        layer["attrs"].update(FP8)
    return table


def wire(x: float) -> float | str | None:
    if math.isnan(x):
        return None
    return x if math.isfinite(x) else "Infinity"


def send(api, run_id: str, n_layers: int, fp8_every: int, steps: range) -> np.ndarray:
    """Steps with FP8 statistics on every one: random values, no weight statistics on
    layer 0, a NaN input amax every 7th step. Returns what was sent, (steps, roles, stats,
    layers) float32, NaN where nothing was."""
    register_run(api, run_id, n_layers=n_layers, layers=layers(n_layers, fp8_every))
    rng = np.random.default_rng(0)
    sent = rng.random((len(steps), len(ROLES), len(STATS), n_layers)).astype(np.float32)
    sent[..., [i for i in range(n_layers) if i % fp8_every]] = np.nan
    sent[:, ROLES.index("weight"), :, 0] = np.nan
    sent[::7, ROLES.index("input"), STATS.index("amax"), fp8_every] = np.nan
    rows = make_steps(steps.start, len(steps), n_layers)
    for row, stats in zip(rows, sent, strict=True):
        row["fp8"] = {role: {name: [None if math.isnan(v) else v for v in stats[r, k].tolist()]
                             for k, name in enumerate(STATS)}
                      for r, role in enumerate(ROLES)}
        row["fp8"]["input"]["amax"] = ["NaN" if v is None and i == fp8_every else v
                                       for i, v in enumerate(row["fp8"]["input"]["amax"])]
    for seq, first in enumerate(range(0, len(rows), 50)):
        answer = post_batch(api, run_id, seq, rows[first : first + 50])
        assert answer.status_code == 200, answer.text
    return sent


def report(api, run_id: str, **params) -> dict:
    answer = api.get(f"/api/v1/runs/{run_id}/fp8", params=params)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    body.pop("findings")  # their times differ
    return body


def reports(api, run_id: str) -> list[dict]:
    return [report(api, run_id, buckets=1000), report(api, run_id, buckets=8),
            report(api, run_id, start=30, end=89, buckets=4)]


def decode(values: list) -> np.ndarray:
    return np.array([np.nan if v is None or v == "NaN" else v for v in values])


def test_the_report_folds_what_was_sent(api):
    sent = send(api, "fp8-small", n_layers=6, fp8_every=2, steps=range(120))
    every, bucketed, _ = reports(api, "fp8-small")
    assert every["steps"] == list(range(120)) and every["samples"] == 120
    assert every["rows"][:3] == [f"blocks.0.fc · {role}" for role in ROLES]
    grad = sent[:, ROLES.index("grad"), STATS.index("underflow"), 0]
    assert np.array_equal(decode(every["underflow"][2]).astype(np.float32), grad)
    starts = [*bucketed["steps"], 120]
    assert bucketed["steps"] == list(range(0, 120, 15))
    expected = [grad[a:b].max() for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert np.array_equal(decode(bucketed["underflow"][2]).astype(np.float32), expected)
    assert set(every["underflow"][1]) == {"NaN"}  # layer 0 sent no weight statistics
    (first,) = [x for x in every["layers"] if x["index"] == 0]
    assert set(first["latest"]) == {"input", "grad"}  # layer 0 sent no weight statistics
    assert first["latest"]["grad"]["amax"] == float(sent[-1, ROLES.index("grad"), 0, 0])


def test_rows_stored_whole_read_as_before_and_paging_changes_nothing(api, app, monkeypatch):
    send(api, "fp8-old", n_layers=6, fp8_every=2, steps=range(120))
    compressed = reports(api, "fp8-old")
    monkeypatch.setattr(fp8_samples, "READ_ROWS", 7)
    assert reports(api, "fp8-old") == compressed
    with app.state.sessionmaker() as session:  # as servers before 0008 stored them
        window = load_fp8_window(session, "fp8-old", 0, 6)
        for step, values, present in zip(window.steps.tolist(), window.values, window.present,
                                         strict=True):
            session.execute(update(Fp8Sample).where(Fp8Sample.step == step).values(
                values=values.tobytes(), present=present.tobytes(), layers=None))
        session.commit()
    assert reports(api, "fp8-old") == compressed


def test_a_wide_run_stores_only_its_fp8_layers(api, app):
    send(api, "fp8-wide", n_layers=1000, fp8_every=100, steps=range(20))
    with app.state.sessionmaker() as session:
        stored = session.scalar(select(func.sum(
            func.length(Fp8Sample.values) + func.length(Fp8Sample.present)
            + func.length(Fp8Sample.layers))))
    per_sample = stored / 20
    # 10 FP8 layers: 150 float32 values and 30 flags, against 60,000 bytes stored whole
    assert per_sample < 1_000, per_sample
    every = report(api, "fp8-wide", buckets=1000)
    assert [x["index"] for x in every["layers"]] == list(range(0, 1000, 100))
    assert len(every["rows"]) == 30 and every["samples"] == 20
