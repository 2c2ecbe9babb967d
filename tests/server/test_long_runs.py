"""Long runs: zoomed-out reads come from the step summaries and agree with the raw values
the test sent; zoomed-in reads are full resolution; every skipped and non-finite step
survives every zoom; archiving keeps the summaries and findings; compacting hands SQLite
space back. Runs on SQLite and Postgres."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from sqlalchemy import delete, func, select

from ampwatch.server.models import Batch, Run, StepSummary
from ampwatch.server.services import series as queries
from ampwatch.server.store.summaries import SUMMARY_STEPS, summarised_steps
from tests.utils import make_layers, make_steps, post_batch, register_run

LONG_RANGE = 3 * SUMMARY_STEPS  # the threshold, lowered from 20,000 to keep the test small
STEPS = 2 * LONG_RANGE
LAYERS = 6
BATCH = 250  # not a divisor of SUMMARY_STEPS: batches straddle summary buckets
SKIPPED = {1_321, 3_000, STEPS - 1}
NAN_STEP, NAN_LAYER = 2_345, 3
SPIKE = 4_444


def grad_norms() -> np.ndarray:
    """The per-layer grad norms the test sends: smooth and noisy, one NaN, infs on skips."""
    rng = np.random.default_rng(7)
    level = np.exp(rng.normal(-2, 1, LAYERS))
    values = (level * np.exp(rng.normal(0, 0.2, (STEPS, LAYERS)))).astype(np.float32)
    values[NAN_STEP, NAN_LAYER] = np.nan
    for s in SKIPPED:
        values[s, 0] = np.inf
    return values


def wire(x: float) -> float | str:
    return x if math.isfinite(x) else ("NaN" if math.isnan(x) else "Infinity")


def send(api, run_id: str, values: np.ndarray) -> None:
    register_run(api, run_id, n_layers=LAYERS)
    for seq, first in enumerate(range(0, STEPS, BATCH)):
        steps = []
        for s in range(first, min(first + BATCH, STEPS)):
            skipped = s in SKIPPED
            steps.append({
                "step": s, "loss_scale": 2.0 ** (16 - (s // 5000)), "skipped": skipped,
                "grad_norm": "Infinity" if skipped else wire(float(values[s].sum())),
                "loss": 3.0 - s / STEPS + (0.5 if s == SPIKE else 0.0),
                "layer_grad_norm": [wire(float(v)) for v in values[s]],
                **({"activations": {"absmax": [1.0 + i + s / STEPS for i in range(LAYERS)]}}
                   if s % 10 == 0 else {}),
            })
        answer = post_batch(api, run_id, seq, steps)
        assert answer.status_code == 200, answer.text


@pytest.fixture
def long_run(api, monkeypatch: pytest.MonkeyPatch) -> tuple[str, np.ndarray]:
    monkeypatch.setattr(queries, "LONG_RANGE_STEPS", LONG_RANGE)
    values = grad_norms()
    send(api, "long-1", values)
    return "long-1", values


def truth_max(values: np.ndarray, first: int, last: int) -> np.ndarray:
    """Per layer over steps [first, last]: NaN if any, else the largest (inf included)."""
    block = values[first : last + 1]
    return np.where(np.isnan(block).any(axis=0), np.nan, np.nanmax(block, axis=0))


def decode(values: list) -> np.ndarray:
    return np.array([{"NaN": np.nan, "Infinity": np.inf}.get(v, v) if isinstance(v, str)
                     else (np.nan if v is None else v) for v in values], dtype=np.float64)


def test_zoomed_out_heatmap_matches_the_raw_values(api, long_run):
    run_id, values = long_run
    matrix = api.get(f"/api/v1/runs/{run_id}/layers/matrix",
                     params={"buckets": 6}).json()
    assert len(matrix["step_start"]) == 6
    for col, (first, last) in enumerate(zip(matrix["step_start"], matrix["step_end"],
                                            strict=True)):
        assert first % SUMMARY_STEPS == 0 and (last + 1) % SUMMARY_STEPS == 0
        got = decode([row[col] for row in matrix["values"]]).astype(np.float32)
        assert np.array_equal(got, truth_max(values, first, min(last, STEPS - 1)),
                              equal_nan=True), (first, last)
    # the NaN cell and the inf cells are where the test put them
    nan_col = next(i for i, s in enumerate(matrix["step_start"]) if s > NAN_STEP) - 1
    assert matrix["values"][NAN_LAYER][nan_col] == "NaN"


def test_any_2000_step_range_comes_back_at_full_resolution(api, long_run):
    run_id, values = long_run
    start, end = 2_000, 3_999
    matrix = api.get(f"/api/v1/runs/{run_id}/layers/matrix",
                     params={"start": start, "end": end, "buckets": 2000}).json()
    assert matrix["step_start"] == list(range(start, end + 1))
    for layer in range(LAYERS):
        got = decode(matrix["values"][layer]).astype(np.float32)
        assert np.array_equal(got, values[start : end + 1, layer], equal_nan=True)
    steps = api.get(f"/api/v1/runs/{run_id}/steps",
                    params={"start": start, "end": end, "max_points": 2000}).json()
    assert [row["step"] for row in steps["items"]] == list(range(start, end + 1))


def test_every_anomaly_and_extreme_survives_the_zoomed_out_steps_chart(api, long_run):
    run_id, _ = long_run
    steps = api.get(f"/api/v1/runs/{run_id}/steps", params={"max_points": 20}).json()
    assert steps["downsampled"] and steps["total"] == STEPS
    assert steps["count"] == len(steps["items"]) <= 20  # what was asked for
    kept = {row["step"]: row for row in steps["items"]}
    events = {row["step"]: row for row in steps["events"]}
    assert set(events) >= SKIPPED  # every anomaly, in its own field
    assert all(events[s]["skipped"] for s in SKIPPED)
    assert SPIKE in kept  # the loss spike, the largest loss after step 0
    assert 0 in kept and STEPS - 1 in kept  # the largest and the smallest loss


def test_zoomed_out_layer_series_is_a_min_max_envelope(api, long_run):
    run_id, values = long_run
    series = api.get(f"/api/v1/runs/{run_id}/layers/{NAN_LAYER}/series",
                     params={"max_points": 10}).json()
    assert series["downsampled"] and series["total"] == STEPS
    for point in series["grad"]:
        first = point["step"]
        block = values[first : first + SUMMARY_STEPS, NAN_LAYER]
        expected_max = np.nan if np.isnan(block).any() else block.max()
        assert np.array_equal(decode([point["grad_norm"]]).astype(np.float32), [expected_max],
                              equal_nan=True)
        assert np.float32(decode([point["grad_norm_min"]])[0]) == np.nanmin(block)


def test_archive_keeps_summaries_and_findings_and_compact_hands_space_back(app, api,
                                                                            long_run):
    run_id, values = long_run
    findings = api.get(f"/api/v1/runs/{run_id}/findings").json()["total"]
    before = api.get(f"/api/v1/runs/{run_id}/layers/matrix", params={"buckets": 6}).json()
    archived = api.post(f"/api/v1/runs/{run_id}/archive")
    assert archived.status_code == 200 and archived.json()["archived_at"]
    assert archived.json()["steps"] == STEPS
    after = api.get(f"/api/v1/runs/{run_id}/layers/matrix", params={"buckets": 6}).json()
    assert after["values"] == before["values"]
    assert api.get(f"/api/v1/runs/{run_id}/findings").json()["total"] == findings
    # zoomed in, an archived run shows its summary buckets (its steps are gone)
    zoom = api.get(f"/api/v1/runs/{run_id}/steps",
                   params={"start": 1000, "end": 1999, "max_points": 2000}).json()
    assert 1_321 in {row["step"] for row in zoom["items"]}
    disk_before = on_disk(app)
    compacted = api.post("/api/v1/storage/compact").json()
    assert compacted["bytes_after"] <= compacted["bytes_before"]
    if compacted["dialect"] == "sqlite":  # the files themselves shrank, -wal included
        assert (compacted["bytes_before"], compacted["bytes_after"]) == (disk_before,
                                                                         on_disk(app))
        assert on_disk(app) < disk_before / 2


def on_disk(app) -> int | None:
    """Bytes of the SQLite database file and its -wal file (None on Postgres)."""
    path = app.state.engine.url.database
    if app.state.engine.dialect.name != "sqlite":
        return None
    return sum(os.path.getsize(p) for p in (path, f"{path}-wal") if os.path.exists(p))


def forget_summaries(app, run_id: str) -> None:
    """Make the run look stored before the step summaries existed."""
    with app.state.sessionmaker() as session:
        session.execute(delete(StepSummary).where(StepSummary.run_id == run_id))
        session.commit()


def test_archiving_a_run_stored_without_summaries_builds_them_first(app, api, long_run):
    run_id, values = long_run
    forget_summaries(app, run_id)
    before = api.get(f"/api/v1/runs/{run_id}/layers/matrix", params={"buckets": 6}).json()
    assert api.post(f"/api/v1/runs/{run_id}/archive").status_code == 200
    with app.state.sessionmaker() as session:
        assert summarised_steps(session, run_id, 0) == STEPS
        assert session.scalar(select(func.count()).select_from(Batch)) == 0
    after = api.get(f"/api/v1/runs/{run_id}/layers/matrix", params={"buckets": 6}).json()
    assert after["values"] == before["values"]  # the summaries say what the raw steps said
    for col, first in enumerate(after["step_start"]):
        got = decode([row[col] for row in after["values"]]).astype(np.float32)
        assert np.array_equal(got, truth_max(values, first, first + SUMMARY_STEPS - 1),
                              equal_nan=True), first
    steps = api.get(f"/api/v1/runs/{run_id}/steps", params={"max_points": 20}).json()
    assert steps["total"] == STEPS and {row["step"] for row in steps["events"]} >= SKIPPED
    assert SPIKE in {row["step"] for row in steps["items"]}
    series = api.get(f"/api/v1/runs/{run_id}/layers/{NAN_LAYER}/series",
                     params={"max_points": 10}).json()
    for point in series["grad"]:
        block = values[point["step"] : point["step"] + SUMMARY_STEPS, NAN_LAYER]
        assert np.float32(decode([point["grad_norm_min"]])[0]) == np.nanmin(block)


def test_archive_refuses_when_neither_summaries_nor_batches_hold_the_steps(app, api):
    register_run(api, "lost", n_layers=2)
    for seq in range(3):
        assert post_batch(api, "lost", seq, make_steps(100 * seq, 100, 2)).status_code == 200
    forget_summaries(app, "lost")
    with app.state.sessionmaker() as session:  # a batch lost, say by an old archive
        session.execute(delete(Batch).where(Batch.seq == 1))
        session.commit()
    refused = api.post("/api/v1/runs/lost/archive")
    assert refused.status_code == 409, refused.text
    assert "200 of its 300 steps" in refused.text
    assert api.get("/api/v1/runs/lost").json()["archived_at"] is None
    with app.state.sessionmaker() as session:
        assert session.scalar(select(func.count()).select_from(Batch)) == 2
        assert summarised_steps(session, "lost", 0) == 0  # the rebuilt ones were not kept


def test_zoomed_out_layer_series_merges_buckets_down_to_max_points(app, api, long_run):
    """More summary buckets (6) than points asked (4): neighbours merge, max of maxima and
    min of minima, and the NaN bucket is an event."""
    run_id, values = long_run
    with app.state.sessionmaker() as session:
        series = queries.layer_series_query(session, session.get(Run, run_id), NAN_LAYER,
                                            max_points=4)
    assert len(series["grad"]) <= 4 and len(series["activations"]) <= 4
    starts = [point["step"] for point in series["grad"]]
    ends = [*starts[1:], STEPS]
    for point, first, end in zip(series["grad"], starts, ends, strict=True):
        block = values[first:end, NAN_LAYER]
        expected_max = np.nan if np.isnan(block).any() else block.max()
        assert np.array_equal(decode([point["grad_norm"]]).astype(np.float32), [expected_max],
                              equal_nan=True)
        assert np.float32(decode([point["grad_norm_min"]])[0]) == np.nanmin(block)
    assert [(p["step"], p["grad_norm"]) for p in series["events"]] == [
        (max(s for s in starts if s <= NAN_STEP), "NaN")]


def fp8_layers(n: int) -> list[dict]:
    """Layers as the agent describes torchao's Float8Linear (agent/fp8.py)."""
    layers = make_layers(n)
    for layer in layers:
        layer["attrs"].update({"fp8_recipe": "dynamic tensorwise", "fp8_input_format": "e4m3",
                               "fp8_weight_format": "e4m3", "fp8_grad_format": "e5m2"})
    return layers


def test_an_archived_fp8_run_keeps_its_fp8_tab_and_says_the_samples_went(api):
    register_run(api, "fp8-old", n_layers=2, layers=fp8_layers(2))
    steps = make_steps(0, 20, 2)
    stats = {"amax": [4.0, 4.0], "scale": [56.0, 56.0], "rms": [1.0, 1.0],
             "saturated": [0.0, 0.0], "underflow": [0.5, 0.0]}
    steps[10]["fp8"] = {"input": stats, "weight": stats, "grad": stats}
    assert post_batch(api, "fp8-old", 0, steps).status_code == 200
    assert 'href="/runs/fp8-old/fp8"' in api.get("/runs/fp8-old").text
    assert api.post("/api/v1/runs/fp8-old/archive").status_code == 200
    assert 'href="/runs/fp8-old/fp8"' in api.get("/runs/fp8-old").text
    tab = api.get("/runs/fp8-old/fp8")
    assert tab.status_code == 200 and "dynamic tensorwise" in tab.text
    assert "the FP8 samples were archived" in tab.text
    register_run(api, "plain", n_layers=2)
    assert "/fp8" not in api.get("/runs/plain").text
