"""bench/scale_sim.py --quick: the scale-out bench runs every shape it can against a real
Postgres (two `ampwatch serve` processes, the worker when there is one), prints its table,
and what it says was committed is what the database holds."""

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import NO_POSTGRES, POSTGRES_URL

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from scale_probes import queue_figures  # noqa: E402
from scale_sim import COLUMNS, spreads  # noqa: E402

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[str, dict]:
    if not POSTGRES_URL:
        pytest.skip(NO_POSTGRES)
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale_sim.py"), "--quick", "--postgres",
         POSTGRES_URL, "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_prints_one_row_per_phase_under_the_header(quick_run):
    stdout, result = quick_run
    header = "| " + " | ".join(COLUMNS) + " |"
    lines = stdout.splitlines()
    assert header in lines
    table = lines[lines.index(header, lines.index(header) + 1) + 2:]  # the final table
    rows = [line.split("|")[1:-1] for line in table if line.startswith("|")]
    shapes = [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows]
    expected = [("a", "16", "1"), ("b", "64", "2")]
    with_worker = "no worker" not in lines[0]
    assert shapes == expected + ([("c", "64", "1")] if with_worker else [])
    assert all(len(r) == len(COLUMNS) for r in rows)
    if not with_worker:
        assert "shape c skipped: this ampwatch has no `ampwatch worker`" in lines
    assert "layer values/s" in stdout


def test_committed_batches_are_the_rows_in_the_database(quick_run):
    _, result = quick_run
    for phase in result["phases"]:
        # 16 batches/s for 3 s: every rank's prefill, then the window's slots
        assert phase["stored"] == phase["acknowledged"] >= phase["ranks"] * phase["runs"]
        assert phase["committed_per_s"] > 0
        assert phase["cpu_ms_servers"] > 0 and phase["cpu_ms_postgres"] > 0
        assert phase["page_reads"] >= 1


def test_every_injected_fault_is_found_once(quick_run):
    _, result = quick_run
    for phase in result["phases"]:
        assert phase["faulted_ranks"] > 0
        assert phase["nonfinite_steps_found"] == phase["nonfinite_steps_sent"] > 0
        assert (phase["findings_lost"], phase["findings_extra"],
                phase["findings_duplicated"]) == (0, 0, 0)


def test_its_database_is_dropped(quick_run):
    _, result = quick_run
    assert result["database"].startswith("ampwatch_scale_")
    admin = make_url(POSTGRES_URL).set(drivername="postgresql")
    with psycopg.connect(admin.render_as_string(hide_password=False)) as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            (result["database"],)).fetchone()[0]
    assert left == 0


def test_queue_figures_read_the_analysis_gauges_only():
    text = (
        "# HELP ampwatch_alert_notifications_pending Alerts not sent yet\n"
        "# TYPE ampwatch_alert_notifications_pending gauge\n"
        "ampwatch_alert_notifications_pending 9.0\n"
        "# HELP ampwatch_analysis_queue_depth Batches waiting for analysis\n"
        "# TYPE ampwatch_analysis_queue_depth gauge\n"
        'ampwatch_analysis_queue_depth{partition="0"} 3.0\n'
        'ampwatch_analysis_queue_depth{partition="1"} 4.0\n'
        "# HELP ampwatch_worker_lag_seconds Age of the oldest waiting batch\n"
        "# TYPE ampwatch_worker_lag_seconds gauge\n"
        "ampwatch_worker_lag_seconds 2.5\n"
    )
    assert queue_figures(text) == (7.0, 2.5)
    assert queue_figures("# TYPE ampwatch_live_runs gauge\nampwatch_live_runs 1.0\n") == (
        None, None)


def test_spreads_are_judged_on_each_phases_median():
    def row(shape, ranks, runs, servers):
        return {"shape": shape, "ranks": ranks, "runs": runs, "cpu_ms_servers": servers,
                "cpu_ms_postgres": 4.0, "cpu_ms_worker": 4.0}

    rows = [row("a", 64, 1, 10.0), row("a", 256, 1, 13.0), row("b", 64, 1, 10.0),
            row("b", 64, 16, 11.0), row("c", 64, 1, 99.0),
            row("a", 64, 1, 10.4), row("a", 256, 1, 11.0), row("b", 64, 1, 10.2),
            row("b", 64, 16, 20.0),
            row("a", 64, 1, 9.0), row("a", 256, 1, 11.4), row("b", 64, 1, 10.0),
            row("b", 64, 16, 11.4)]
    result = spreads(rows)
    assert result["R"]["servers"] == {64: 10.0, 256: 11.4}  # one outlier of 13.0 left out
    assert result["R"]["servers_spread"] == pytest.approx(1.14)
    assert result["R"]["total_spread"] == pytest.approx(19.4 / 18.0)
    assert result["K"]["servers"] == {1: 10.0, 16: 11.4} and result["K"]["repeats"] == 3
    assert spreads(rows[:1]) == {}  # one phase a shape: nothing to compare
