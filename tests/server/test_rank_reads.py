"""Reads that do not grow with ranks: the run page, `/ranks` and the combined grad norms
issue the same SQL statements for a run of 1, 8, 48 and 64 ranks; the run page fetches
the same rows, run_ranks' included, at 48 ranks as at 64 (its ranks panel holds at most
PANEL_ROWS ranks, its totals are one aggregate row), and `/ranks` no more batch rows at
64 ranks than at 8 (server/store/rollups.py, the run page's overlay of at most
MAX_OVERLAID_RANKS ranks).

Counted on SQLite, where every statement goes through the engine's cursor events (on
Postgres the batch reads use psycopg's binary cursor directly); rows fetched are counted
by running each SELECT again as `SELECT count(*) FROM (...)` in the same transaction.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from ampwatch.server.models import RankRollup
from ampwatch.server.services.ranks import MAX_OVERLAID_RANKS, PANEL_ROWS
from ampwatch.server.store.rollups import PANEL_STEPS
from tests.utils import WAIT, make_steps, post_batch, register_run

N_LAYERS = 8
BATCHES, PER_BATCH = 3, 20
SIZES = (1, 8, 48, 64)  # the last two past PANEL_ROWS


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One app on a SQLite file holding a run of each size in SIZES, every rank sending
    BATCHES batches, round by round as ranks do."""
    from fastapi.testclient import TestClient

    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    path = Path(tmp_path_factory.mktemp("rank-reads"), "ampwatch.db")
    app = create_app(Settings(database_url=f"sqlite:///{path}"))
    with TestClient(app, raise_server_exceptions=True) as api:
        for size in SIZES:
            register_run(api, f"r{size}", n_layers=N_LAYERS,
                         environment={"world_size": size, "grad_layout": "sharded"})
            for seq in range(BATCHES):
                for rank in range(size):
                    steps = make_steps(seq * PER_BATCH, PER_BATCH, N_LAYERS, sample_every=10)
                    assert post_batch(api, f"r{size}", seq, steps, rank=rank).status_code == 200
        for size in SIZES:  # the analysis of the batches done: none of it counted then
            run = api.get(f"/api/v1/runs/r{size}", params=WAIT).json()
            assert run["analysis_pending"] == 0
        yield api
    close_app(app)


@contextmanager
def counted(engine) -> Iterator[dict]:
    """Statements (their SQL, in order) and rows fetched per table while the block runs."""
    seen: dict = {"statements": [], "rows": Counter()}

    def after(conn, cursor, statement, parameters, context, executemany) -> None:
        if "FROM analysis_queue" in statement:
            return  # the in-process worker polls it whenever it likes: not the read's work
        seen["statements"].append(statement)
        if statement.lstrip().upper().startswith("SELECT"):
            recount = cursor.connection.cursor()
            n = recount.execute(f"SELECT count(*) FROM ({statement})", parameters).fetchone()[0]
            recount.close()
            table = re.search(r"\bFROM (\w+)", statement)
            seen["rows"][table.group(1) if table else "?"] += n

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        event.remove(engine, "after_cursor_execute", after)


def reads(client, path: str) -> dict:
    with counted(client.app.state.engine) as seen:
        response = client.get(path)
    assert response.status_code == 200, response.text
    return {**seen, "answer": response}


def shapes(seen: dict) -> list[tuple[str, str]]:
    """Each statement as its verb and table."""
    return [(sql.split()[0], re.search(r"\b(?:FROM|INTO|UPDATE) (\w+)", sql).group(1))
            for sql in seen["statements"]]


@pytest.mark.parametrize("path", ["/runs/{run}", "/runs/{run}?format=json"])
def test_the_run_page_fetches_the_same_rows_whatever_the_number_of_ranks(client, path):
    by_size = {size: reads(client, path.format(run=f"r{size}")) for size in SIZES}
    # the same statements, in the same order, for every size (up to which ranks a batch
    # read names)
    assert len({tuple(shapes(seen)) for seen in by_size.values()}) == 1
    # past PANEL_ROWS ranks, the same rows from every table, run_ranks included: the
    # lead, at most PANEL_ROWS panel rows and the one row of totals
    assert by_size[48]["rows"] == by_size[64]["rows"]
    assert by_size[64]["rows"]["run_ranks"] == 1 + PANEL_ROWS + 1
    assert by_size[8]["rows"]["run_ranks"] == 1 + 8 + 1
    twin = client.get("/runs/r64?format=json").json()
    assert [r["rank"] for r in twin["ranks"]] == list(range(PANEL_ROWS))  # none differs
    assert twin["run"]["n_ranks"] == 64 and len(twin["run"]["ranks"]) == PANEL_ROWS
    assert f"{PANEL_ROWS} of 64 ranks shown" in client.get("/runs/r64").text


@pytest.mark.parametrize("path", ["/api/v1/runs/{run}/ranks", "/api/v1/runs/{run}"])
def test_the_ranks_api_reads_the_same_statements_whatever_the_number_of_ranks(client, path):
    by_size = {size: reads(client, path.format(run=f"r{size}")) for size in SIZES}
    assert len({tuple(shapes(seen)) for seen in by_size.values()}) == 1
    # one narrow row per rank from run_ranks (and at most one row of totals); from every
    # other table the same rows at 64 ranks as at 8
    for size, seen in by_size.items():
        assert seen["rows"]["run_ranks"] - size in (0, 1), (size, seen["rows"])
    eight, many = by_size[8]["rows"], by_size[64]["rows"]
    assert eight - Counter(run_ranks=eight["run_ranks"]) == \
        many - Counter(run_ranks=many["run_ranks"])


def test_the_ranks_panel_reads_no_batch(client):
    seen = reads(client, "/api/v1/runs/r64/ranks")
    assert seen["rows"]["batches"] == 0 and seen["rows"]["step_summaries"] == 0
    items = seen["answer"].json()["items"]
    assert [item["rank"] for item in items] == list(range(64))
    assert {item["step_ms_median"] for item in items} == {33.0}  # make_steps' t_step_ms


def test_the_ranks_api_pages_by_rank_reading_at_most_a_page_of_rows(client):
    """`limit` ranks an answer, however many the run has: following `next_after` lists
    every rank once, in order, each page fetching at most limit + 1 rank rows (and the
    count)."""
    seen_ranks, after, pages = [], -1, 0
    while after is not None:
        seen = reads(client, f"/api/v1/runs/r64/ranks?limit=10&after={after}")
        body = seen["answer"].json()
        assert seen["rows"]["run_ranks"] <= 10 + 1 + 1, seen["rows"]
        assert (body["n_ranks"], body["world_size"]) == (64, 64)
        assert len(body["items"]) == (10 if body["next_after"] is not None else 4)
        seen_ranks += [item["rank"] for item in body["items"]]
        after, pages = body["next_after"], pages + 1
    assert seen_ranks == list(range(64)) and pages == 7
    whole = client.get("/api/v1/runs/r64/ranks").json()  # the default page holds them all
    assert [i["rank"] for i in whole["items"]] == list(range(64)) and whole["next_after"] is None
    for bad in ("limit=0", "limit=4097", "after=-2", "after=x"):
        assert client.get(f"/api/v1/runs/r64/ranks?{bad}").status_code == 422, bad


@pytest.mark.parametrize("path", ["/api/v1/runs", "/?format=json",
                                  "/compare?run=r1&run=r64&format=json"])
def test_the_runs_list_and_compare_read_one_rank_row_a_run(client, path):
    """A list of runs carries each run's lead rank (n_ranks counts the others): the run
    of 64 ranks costs the list what the run of 1 does."""
    seen = reads(client, path)
    body = seen["answer"].json()
    runs = body.get("items") or body.get("runs")
    assert {r["id"]: (r["n_ranks"], [k["rank"] for k in r["ranks"]]) for r in runs} == {
        f"r{size}": (size, [0]) for size in (SIZES if "compare" not in path else (1, 64))}
    # one lead row and one row of totals a run, whatever its ranks
    assert seen["rows"]["run_ranks"] <= 3 * len(runs), seen["rows"]


def test_combined_grad_norms_issue_the_same_statements_whatever_the_number_of_ranks(client):
    by_size = {size: reads(client, f"/api/v1/runs/r{size}/grad_norms?layers=true")
               for size in SIZES}
    assert len({tuple(shapes(seen)) for seen in by_size.values()}) == 1
    for size, seen in by_size.items():
        answer = seen["answer"].json()
        assert answer["ranks"] == size
        # sharded: the square root of the ranks' summed squares, every rank the same here
        expected = [np.sqrt(size) * g for g in
                    (1.0 + (s % 7) / 10 for s in range(BATCHES * PER_BATCH))]
        assert np.allclose(answer["grad_norm"], expected, rtol=1e-12)


def test_the_run_page_draws_the_lead_the_ranks_that_differ_and_the_slowest(api):
    client, run = api, "odd-ranks"
    register_run(client, run, n_layers=N_LAYERS, environment={"world_size": 16})
    for rank in range(16):
        steps = make_steps(0, 30, N_LAYERS, skipped={12} if rank == 9 else frozenset())
        for step in steps:
            step["t_step_ms"] = 90.0 if rank == 5 else 33.0 + rank / 100
        assert post_batch(client, run, 0, steps, rank=rank).status_code == 200
    twin = client.get(f"/runs/{run}?format=json").json()
    drawn = twin["overlaid_ranks"]
    assert len(drawn) == MAX_OVERLAID_RANKS and drawn == sorted(drawn)
    assert {0, 9, 5} <= set(drawn)  # the lead, the one that skipped, the slowest
    assert {0, 9, 5, 15, 14} <= set(drawn)  # then the slowest of the rest: the higher ranks
    assert {item["rank"] for item in twin["steps"]["items"]} == set(drawn)
    picked = client.get(f"/runs/{run}?format=json&rank=3").json()
    assert picked["overlaid_ranks"] is None
    assert {item["rank"] for item in picked["steps"]["items"]} == {3}
    page = client.get(f"/runs/{run}").text
    assert "The charts draw ranks " + ", ".join(map(str, drawn)) + " of 16" in page


def test_the_ranks_panel_shows_the_ranks_that_differ_then_the_slowest_then_the_lowest(api):
    """40 ranks, past PANEL_ROWS: rank 37 skips a step, rank 38 runs at another loss scale
    and the step times grow with the rank number (rank 39 the slowest by far)."""
    client, run, size = api, "many-ranks", 40
    register_run(client, run, n_layers=N_LAYERS, environment={"world_size": size})
    for rank in range(size):
        steps = make_steps(0, 20, N_LAYERS, skipped={12} if rank == 37 else frozenset(),
                           loss_scale=32768.0 if rank == 38 else 65536.0)
        for step in steps:
            step["t_step_ms"] = 90.0 if rank == 39 else 33.0 + rank / 100
        assert post_batch(client, run, 0, steps, rank=rank).status_code == 200
    twin = client.get(f"/runs/{run}?format=json").json()
    slowest = sorted(range(size), key=lambda r: 90.0 if r == 39 else 33.0 + r / 100)[-8:]
    picked = {0, 37, 38, *slowest}
    lowest = [r for r in range(size) if r not in picked][:PANEL_ROWS - len(picked)]
    assert [r["rank"] for r in twin["ranks"]] == sorted(picked | set(lowest))
    assert twin["run"]["n_ranks"] == size and twin["run"]["steps"] == 20 * size
    assert twin["run"]["skipped"] == 1  # the totals count every rank, not the panel's
    assert {0, 37, 38, 39} <= set(twin["overlaid_ranks"])
    page = client.get(f"/runs/{run}").text
    assert f"{PANEL_ROWS} of 40 ranks shown" in page
    assert f'href="/api/v1/runs/{run}/ranks"' in page


def test_step_time_median_follows_restarts_and_repeated_steps(client):
    """The panel's median against the test's own steps: the last PANEL_STEPS steps as the
    rank holds them after a restart and after a batch that repeats stored steps."""
    run = "timed"
    register_run(client, run, n_layers=N_LAYERS)
    truth: dict[int, float] = {}

    def send(seq: int, first: int, count: int, base: float, **fields) -> None:
        steps = make_steps(first, count, N_LAYERS)
        for step in steps:
            step["t_step_ms"] = base + (step["step"] * 37 % 101)
            truth[step["step"]] = step["t_step_ms"]
        assert post_batch(client, run, seq, steps, **fields).status_code == 200

    def panel_median() -> float:
        return client.get(f"/api/v1/runs/{run}/ranks").json()["items"][0]["step_ms_median"]

    def expected() -> float:
        return statistics.median(truth[s] for s in sorted(truth)[-PANEL_STEPS:])

    for seq in range(6):
        send(seq, seq * 50, 50, 10.0)
        assert panel_median() == expected()
    send(6, 220, 30, 500.0, events=[{"step": 220, "kind": "restart", "detail": {}}])
    for step in range(250, 300):
        truth.pop(step)  # superseded by the restart
    assert panel_median() == expected()
    send(7, 240, 20, 900.0)  # the same steps again, no restart: the last copy counts
    assert panel_median() == expected()


def test_a_batch_rewrites_only_the_rollups_it_changed(tmp_path):
    """A 1,000-layer batch writes the last grad norm (8 KB) and the step-time window, not
    the rank's 64 KB of per-layer statistics; a sampled one adds what moved."""
    from fastapi.testclient import TestClient

    from ampwatch.server.app import close_app, create_app
    from ampwatch.server.settings import Settings

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'w.db'}"))
    with TestClient(app) as api:
        register_run(api, "wide", n_layers=1000)
        assert post_batch(api, "wide", 0, make_steps(0, 20, 1000)).status_code == 200
        written = Counter()

        def before(conn, cursor, statement, parameters, context, executemany) -> None:
            if statement.startswith(("UPDATE rank_rollups", "INSERT INTO rank_rollups")):
                written["rows"] += len(parameters) if executemany else 1
                rows = parameters if executemany else [parameters]
                written["bytes"] += sum(len(p[0]) for p in rows)

        event.listen(app.state.engine, "before_cursor_execute", before)
        steps = make_steps(20, 20, 1000)
        for step in steps:
            step["layer_grad_norm"] = [0.001 * (i + 1) for i in range(1000)]  # below the max
        assert post_batch(api, "wide", 1, steps).status_code == 200
        event.remove(app.state.engine, "before_cursor_execute", before)
        assert written["rows"] == 2  # the last grad norm and the step-time window
        assert written["bytes"] <= 8000 + PANEL_STEPS * 16
        with app.state.sessionmaker() as session:
            rollups = session.scalars(select(RankRollup.rollup).where(
                RankRollup.run_id == "wide")).all()
        assert sorted(rollups) == list(range(9))
    close_app(app)


def test_migration_0013_moves_each_ranks_layer_statistics_and_back(database_url):
    """The statistics stored in run_ranks.layer_stats before 0013 read back the same from
    rank_rollups after it, and go back into the blob on downgrade."""
    from alembic import command
    from alembic.script import ScriptDirectory
    from sqlalchemy import text

    from ampwatch.server.db import alembic_config, make_engine
    from ampwatch.server.store.rollups import LAYER_STATS_ROWS, load_layer_stats

    engine = make_engine(database_url)
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    before = ScriptDirectory.from_config(cfg).get_revision("0013").down_revision
    stats = np.random.default_rng(0).random((LAYER_STATS_ROWS, 5))

    def migrate(step, revision: str) -> None:
        with engine.begin() as connection:
            cfg.attributes["connection"] = connection
            step(cfg, revision)

    migrate(command.upgrade, "head")  # an empty database, or one another test migrated
    migrate(command.downgrade, before)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, project, tags, config, environment, "
                          "status, open_findings, n_layers, created_at, updated_at) VALUES "
                          "('old', 'old', 'p', '[]', '{}', '{}', 'healthy', 0, 5, "
                          "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO run_ranks (run_id, rank, batches, max_seq, steps, "
                          "skipped, dropped_batches, dropped_steps, layer_stats) VALUES "
                          "('old', 3, 1, 0, 10, 0, 0, 0, :blob)"), {"blob": stats.tobytes()})
    migrate(command.upgrade, "0013")
    with Session(engine) as session:
        assert np.array_equal(load_layer_stats(session, "old", 3, 5), stats)
    migrate(command.downgrade, before)
    with engine.connect() as conn:
        blob = conn.execute(text("SELECT layer_stats FROM run_ranks")).scalar_one()
    assert bytes(blob) == stats.tobytes()
    migrate(command.upgrade, "head")
    engine.dispose()
