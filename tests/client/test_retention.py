"""`ampwatch runs archive` and `ampwatch runs delete` against a real server process."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text

from ampwatch.client.commands.retention import age
from tests.client.conftest import seed_healthy


def test_ages_parse_and_bad_ones_are_refused():
    assert age("90d") == timedelta(days=90)
    assert age("12h") == timedelta(hours=12)
    assert age(" 2w ") == timedelta(weeks=2)
    with pytest.raises(Exception, match="not an age"):
        age("90 days")


def backdate(server, run_id: str, days: int) -> None:
    """Make a run look `days` old (its last data and creation), in the server's database."""
    engine = create_engine(server.database_url)
    moment = datetime.now(UTC) - timedelta(days=days)
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET created_at = :m WHERE id = :id"),
                     {"m": moment, "id": run_id})
        conn.execute(text("UPDATE run_ranks SET last_seen_at = :m WHERE run_id = :id"),
                     {"m": moment, "id": run_id})
    engine.dispose()


def test_archive_older_than_archives_only_old_runs_and_keeps_their_totals(
        ampwatch, server, server_api):
    seed_healthy(server_api, "ret-old", steps=400)
    seed_healthy(server_api, "ret-new", steps=400)
    backdate(server, "ret-old", days=120)
    dry = ampwatch("runs", "archive", "--older-than", "90d", "--dry-run")
    assert dry.code == 0, dry.err
    assert "would archive ret-old" in dry.out and "ret-new" not in dry.out
    assert server_api.get("/api/v1/runs/ret-old").json()["archived_at"] is None
    done = ampwatch("runs", "archive", "--older-than", "90d", "--json")
    assert done.code == 0, done.err
    assert json.loads(done.out)["archived"] == ["ret-old"]
    old = server_api.get("/api/v1/runs/ret-old").json()
    assert old["archived_at"] and old["steps"] == 400
    assert server_api.get("/api/v1/runs/ret-new").json()["archived_at"] is None
    again = ampwatch("runs", "archive", "--older-than", "90d")
    assert again.code == 0 and "no run to archive" in again.out


def test_a_named_run_that_is_live_or_archived_is_skipped_with_the_reason(
        ampwatch, server, server_api):
    seed_healthy(server_api, "ret-live", steps=200)
    seed_healthy(server_api, "ret-done", steps=200)
    backdate(server, "ret-done", days=1)
    assert ampwatch("runs", "archive", "ret-done").code == 0
    result = ampwatch("runs", "archive", "ret-live", "ret-done")
    assert result.code == 0, result.err
    assert "skipped ret-live: live (it is still sending data)" in result.out
    assert "skipped ret-done: archived already" in result.out
    assert "no run to archive" not in result.out
    as_json = json.loads(ampwatch("runs", "archive", "ret-live", "--json").out)
    assert as_json == {"archived": [], "would_archive": [], "skipped": {"ret-live": "live"}}
    assert server_api.get("/api/v1/runs/ret-live").json()["archived_at"] is None


def test_delete_removes_the_run_and_compacts(ampwatch, server_api):
    seed_healthy(server_api, "ret-gone", steps=300)
    done = ampwatch("runs", "delete", "ret-gone")
    assert done.code == 0, done.err
    assert "deleted ret-gone" in done.out and "compacted the sqlite database" in done.out
    assert server_api.get("/api/v1/runs/ret-gone").status_code == 404


def test_archive_needs_runs_or_an_age(ampwatch):
    result = ampwatch("runs", "archive")
    assert result.code != 0
    assert "--older-than" in result.err


def test_a_compaction_cut_off_still_reports_what_was_archived(ampwatch, server, server_api):
    seed_healthy(server_api, "ret-slow", steps=300)
    backdate(server, "ret-slow", days=1)  # live runs are not archived
    # a VACUUM takes longer than a millisecond: the client stops waiting, the server goes on
    done = ampwatch("runs", "archive", "ret-slow", "--compact-timeout", "0.001", "--json")
    assert done.code != 0
    assert json.loads(done.out)["archived"] == ["ret-slow"]
    assert "archived 1 run(s), but compacting the database failed" in done.err
    assert "within 0.001 s" in done.err
    assert server_api.get("/api/v1/runs/ret-slow").json()["archived_at"]


def test_a_compaction_cut_off_after_a_delete_says_the_run_is_gone(ampwatch, server_api):
    seed_healthy(server_api, "ret-cut", steps=300)
    done = ampwatch("runs", "delete", "ret-cut", "--compact-timeout", "0.001")
    assert done.code != 0
    assert "deleted ret-cut" in done.out
    assert "deleted 1 run(s), but compacting the database failed" in done.err
    assert server_api.get("/api/v1/runs/ret-cut").status_code == 404


def test_compaction_help_says_it_stalls_ingest(ampwatch, capsys):
    with pytest.raises(SystemExit):
        ampwatch("runs", "archive", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "stalls the server's ingest" in text and "--compact-timeout" in text
