"""A rank restarted from a checkpoint sends steps it already sent, its first batch with a
`restart` event: the re-done steps supersede the stored ones (no duplicates, no gap), the
rank's totals and summaries count each step once, and the history keeps the event with
what it superseded. SQLite and Postgres."""

from __future__ import annotations

from ampwatch.server.store.fp8_samples import STATS, load_fp8_window
from ampwatch.server.store.storage import load_series
from ampwatch.server.store.summaries import load_summaries
from tests.utils import make_steps, post_batch, register_run

N_LAYERS = 2


def redone(first: int, count: int) -> list[dict]:
    """Steps of the restarted job: told apart from the first copies by their loss."""
    steps = make_steps(first, count, N_LAYERS)
    for step in steps:
        step["loss"] = 9.0
    return steps


def restart(step: int) -> dict:
    return {"step": step, "kind": "restart", "detail": {}}


def stored(api, run_id: str) -> list[dict]:
    reply = api.get(f"/api/v1/runs/{run_id}/steps")
    assert reply.status_code == 200, reply.text
    return reply.json()["items"]


def test_restart_supersedes_the_redone_steps(api, app) -> None:
    register_run(api, "crashed", n_layers=N_LAYERS)
    for seq in range(3):  # steps 0..29, step 25 skipped
        assert post_batch(api, "crashed", seq,
                          make_steps(10 * seq, 10, N_LAYERS, skipped={25})).status_code == 200

    assert post_batch(api, "crashed", 3, redone(15, 10), events=[restart(15)]).status_code == 200
    items = stored(api, "crashed")
    assert [s["step"] for s in items] == list(range(25))  # 25..29 of the crashed job: gone
    assert [s["loss"] == 9.0 for s in items] == [False] * 15 + [True] * 10

    assert post_batch(api, "crashed", 4, redone(25, 10)).status_code == 200
    items = stored(api, "crashed")
    assert [s["step"] for s in items] == list(range(35))
    assert all(s["loss"] == 9.0 for s in items[15:]) and not any(s["skipped"] for s in items)
    (rank,) = api.get("/api/v1/runs/crashed").json()["ranks"]
    assert (rank["steps"], rank["skipped"], rank["last_step"]) == (35, 0, 34)

    with app.state.sessionmaker() as session:
        history = load_series(session, "crashed", 0, n_layers=N_LAYERS)
        envelope = load_summaries(session, "crashed", 0, None, None, N_LAYERS).envelope
    # the zoomed-out summaries forgot the crashed job's skipped step 25 too
    assert not envelope.skipped.any() and envelope.column("loss").max() == 9.0
    restarts = [e for e in history.events if e["kind"] == "restart"]
    assert restarts == [{"step": 15, "kind": "restart",
                         "detail": {"previous_last_step": 29, "superseded_steps": 15}}]

    replay = post_batch(api, "crashed", 3, redone(15, 10), events=[restart(15)])
    assert replay.json()["duplicate"]
    assert [s["step"] for s in stored(api, "crashed")] == list(range(35))


def test_a_second_restart_further_back(api) -> None:
    register_run(api, "twice", n_layers=N_LAYERS)
    post_batch(api, "twice", 0, make_steps(0, 20, N_LAYERS))
    post_batch(api, "twice", 1, redone(10, 5), events=[restart(10)])  # crashed again at 14
    post_batch(api, "twice", 2, make_steps(5, 20, N_LAYERS), events=[restart(5)])
    items = stored(api, "twice")
    assert [s["step"] for s in items] == list(range(25))
    assert not any(s["loss"] == 9.0 for s in items)
    (rank,) = api.get("/api/v1/runs/twice").json()["ranks"]
    assert rank["steps"] == 25


def with_fp8(steps: list[dict], amax: float) -> list[dict]:
    """The steps, every fifth one carrying FP8 cast statistics with this abs-max."""
    for step in steps:
        if step["step"] % 5 == 0:
            stats = {name: [amax if name == "amax" else 0.0] * N_LAYERS for name in STATS}
            step["fp8"] = {"input": stats}
    return steps


def test_restart_drops_the_crashed_jobs_fp8_samples(api, app) -> None:
    register_run(api, "fp8-crash", n_layers=N_LAYERS)
    post_batch(api, "fp8-crash", 0, with_fp8(make_steps(0, 30, N_LAYERS), amax=1.0))
    post_batch(api, "fp8-crash", 1, with_fp8(make_steps(12, 5, N_LAYERS), amax=2.0),
               events=[restart(12)])  # crashed at 29, resumed from 12, crashed again at 16
    with app.state.sessionmaker() as session:
        window = load_fp8_window(session, "fp8-crash", 0, N_LAYERS)
    # 20 and 25 came from the first job, which the restart superseded; 15 was re-done
    assert window.steps.tolist() == [0, 5, 10, 15]
    assert window.stat("input", "amax")[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0]


def test_a_step_sent_twice_without_a_restart_is_summarised_once(api, app) -> None:
    register_run(api, "sent-twice", n_layers=N_LAYERS)
    assert post_batch(api, "sent-twice", 0,
                      make_steps(0, 20, N_LAYERS, skipped={15})).status_code == 200
    # steps 10..19 again under a new seq, with no restart (a batch moved after a 409, a
    # late replay): reads keep the later copy, which did not skip step 15
    assert post_batch(api, "sent-twice", 1, redone(10, 10)).status_code == 200
    items = stored(api, "sent-twice")
    assert [s["step"] for s in items] == list(range(20)) and not any(s["skipped"] for s in items)
    (rank,) = api.get("/api/v1/runs/sent-twice").json()["ranks"]
    assert (rank["steps"], rank["skipped"]) == (20, 0)
    with app.state.sessionmaker() as session:
        summary = load_summaries(session, "sent-twice", 0, None, None, N_LAYERS)
    assert summary.n_steps == 20
    envelope = summary.envelope
    assert len(set(envelope.steps.tolist())) == len(envelope)  # no step twice
    assert not envelope.skipped.any() and envelope.column("loss").max() == 9.0


def test_findings_of_superseded_steps_go_with_them(api) -> None:
    register_run(api, "bad-tail", n_layers=N_LAYERS,
                 environment={"autocast_dtype": "float16",
                              "scaler": {"enabled": True, "growth_interval": 2000}})
    # the crashed job skipped steps 40..59 (inf grads): findings from step 40 on
    post_batch(api, "bad-tail", 0, make_steps(0, 60, N_LAYERS, skipped=set(range(40, 60))))
    raised = api.get("/api/v1/runs/bad-tail/findings").json()["items"]
    assert any(f["step"] is not None and f["step"] >= 40 for f in raised)
    # resumed from 30: the re-done steps 30..79 are healthy, so no stored step is bad
    post_batch(api, "bad-tail", 1, make_steps(30, 50, N_LAYERS), events=[restart(30)])
    assert not any(s["skipped"] for s in stored(api, "bad-tail"))
    left = api.get("/api/v1/runs/bad-tail/findings").json()["items"]
    assert [f for f in left if f["step"] is not None and f["step"] >= 30] == []
    assert api.get("/api/v1/runs/bad-tail").json()["status"] == "healthy"
