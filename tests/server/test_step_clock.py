"""The step clock of the time axes (`?x=relative`, `?x=wall`) is kept in the step
summaries at ingest: zoomed out and zoomed in it agrees with the running sum of every
stored step's `t_step_ms` the test computes itself (a re-sent step counted once, as
reads see it), reads no step of a zoomed-out range, and buckets folded before migration
0019 (no clock kept) are read from their steps. Runs on SQLite and Postgres."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import update

from ampwatch.server.models import StepSummary
from ampwatch.server.services import series as queries
from ampwatch.server.store import step_clock
from ampwatch.server.store.summaries import SUMMARY_STEPS
from tests.utils import make_steps, post_batch, register_run

LONG_RANGE = 3 * SUMMARY_STEPS  # the summaries' threshold, lowered from 20,000
STEPS = 7_300
BATCH = 300  # batches straddle buckets
LOST = range(2_000, 2_400)  # never stored
RESENT = range(1_500, 1_700)  # sent again at the end, with other times


def timed(step: dict, resent: bool = False) -> dict:
    """`step` with its t_step_ms: none on some steps, NaN on others (both add nothing)."""
    s = step["step"]
    step = {k: v for k, v in step.items() if k != "t_step_ms"}
    if s % 97:
        step["t_step_ms"] = "NaN" if s % 211 == 0 else 10.0 + (s % 13) * 0.37 + 5.5 * resent
    return step


@pytest.fixture
def timed_run(api, monkeypatch: pytest.MonkeyPatch) -> dict[int, float]:
    """The run "clocked", and the clock at each stored step as the test computes it."""
    monkeypatch.setattr(queries, "LONG_RANGE_STEPS", LONG_RANGE)
    register_run(api, "clocked", n_layers=2)
    stored = [timed(s) for s in make_steps(0, STEPS, 2, skipped={77, 5_001})
              if s["step"] not in LOST]
    again = [timed(s, resent=True) for s in stored if s["step"] in RESENT]
    batches = [stored[i:i + BATCH] for i in range(0, len(stored), BATCH)]
    for seq, batch in enumerate([*batches, again]):
        answer = post_batch(api, "clocked", seq, batch)
        assert answer.status_code == 200, answer.text
    times = {s["step"]: s.get("t_step_ms") for s in [*stored, *again]}  # the last copy
    clock, total = {}, 0.0
    for i, step in enumerate(sorted(times)):
        ms = times[step]
        total += ms if i and isinstance(ms, float) else 0.0
        clock[step] = total
    return clock


def drawn(api, query: str) -> list[dict]:
    twin = api.get(f"/runs/clocked?format=json&x=relative{query}").json()["steps"]
    return twin["items"] + twin["events"]


def agrees(rows: list[dict], clock: dict[int, float]) -> None:
    assert rows
    for row in rows:
        assert math.isclose(row["elapsed_ms"], clock[row["step"]], rel_tol=1e-12,
                            abs_tol=1e-9), row["step"]


def test_the_clock_agrees_zoomed_out_and_zoomed_in(api, timed_run, monkeypatch):
    reads = []
    real = step_clock.load_series
    monkeypatch.setattr(step_clock, "load_series",
                        lambda *a, **k: reads.append(a[3:5]) or real(*a, **k))
    rows = drawn(api, "")
    agrees(rows, timed_run)
    assert {77, 5_001} <= {row["step"] for row in rows}
    assert reads == []  # every drawn row was an envelope row: no step read
    zoomed = drawn(api, "&start=4100&end=4900")
    agrees(zoomed, timed_run)
    assert len(zoomed) == 801
    assert reads == [(4_000, 4_999)]  # the drawn bucket's steps, not the run's


def test_buckets_folded_without_a_clock_are_read_from_their_steps(app, api, timed_run):
    with app.state.sessionmaker() as session, session.begin():
        session.execute(update(StepSummary).where(StepSummary.bucket.in_([0, 3]))
                        .values(step_ms_sum=None, first_step_ms=None, elapsed=None))
    agrees(drawn(api, ""), timed_run)
    agrees(drawn(api, "&start=3500&end=3900"), timed_run)
