"""Archiving a run keeps what the agent told the server besides its steps (restarts with
what they superseded, speed checks, the end of the run), and a batch that arrives after
the archive makes the run live data again: not archived, so a later archive drops it too.
SQLite and Postgres."""

from __future__ import annotations

from ampwatch.server.store.storage import load_series
from tests.utils import make_steps, post_batch, register_run

N_LAYERS = 2
SPEED = {"step": 12, "kind": "speed_check",
         "detail": {"fp32_ms": 30.0, "amp_ms": 10.0, "speedup": 3.0, "dtype": "float16"}}
RESTART = {"step": 20, "kind": "restart", "detail": {}}
FINISHED = {"step": None, "kind": "finished", "detail": {}}


def events_of(app, run_id: str) -> list[dict]:
    with app.state.sessionmaker() as session:
        return load_series(session, run_id, 0, n_layers=N_LAYERS).events


def archive(api, run_id: str) -> dict:
    reply = api.post(f"/api/v1/runs/{run_id}/archive")
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_archiving_keeps_the_agents_events(api, app) -> None:
    register_run(api, "done", n_layers=N_LAYERS)
    assert post_batch(api, "done", 0, make_steps(0, 15, N_LAYERS),
                      events=[SPEED]).status_code == 200
    # crashed at 29 and resumed from 20: the restart event records what it superseded
    assert post_batch(api, "done", 1, make_steps(15, 15, N_LAYERS)).status_code == 200
    assert post_batch(api, "done", 2, make_steps(20, 10, N_LAYERS),
                      events=[RESTART, FINISHED]).status_code == 200
    before = events_of(app, "done")
    assert [e["kind"] for e in before] == ["speed_check", "restart", "finished"]
    assert before[1]["detail"] == {"previous_last_step": 29, "superseded_steps": 10}

    archived = archive(api, "done")
    assert archived["archived_at"] and archived["steps"] == 30
    assert api.get("/api/v1/runs/done/steps",
                   params={"max_points": 100}).json()["total"] == 30  # the summaries
    assert events_of(app, "done") == before
    archive(api, "done")  # idempotent: archiving again keeps them once
    assert events_of(app, "done") == before


def test_a_batch_after_the_archive_unmarks_the_run(api, app) -> None:
    register_run(api, "resumed", n_layers=N_LAYERS)
    assert post_batch(api, "resumed", 0, make_steps(0, 20, N_LAYERS)).status_code == 200
    archive(api, "resumed")
    assert post_batch(api, "resumed", 1, make_steps(20, 10, N_LAYERS)).status_code == 200
    run = api.get("/api/v1/runs/resumed").json()
    assert run["archived_at"] is None and run["steps"] == 30
    # archived again, the new steps go the way of the old ones, and all 30 stay counted
    again = archive(api, "resumed")
    assert again["archived_at"] and again["steps"] == 30
    assert api.get("/api/v1/runs/resumed/steps",
                   params={"max_points": 100}).json()["total"] == 30


def test_an_event_only_batch_after_the_archive_leaves_it_archived(api) -> None:
    register_run(api, "closed", n_layers=N_LAYERS)
    assert post_batch(api, "closed", 0, make_steps(0, 20, N_LAYERS)).status_code == 200
    archive(api, "closed")
    # the detach's late "finished" event adds no data to keep at full resolution
    assert post_batch(api, "closed", 1, [], events=[FINISHED]).status_code == 200
    assert api.get("/api/v1/runs/closed").json()["archived_at"]
