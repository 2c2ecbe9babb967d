"""Storage stays at most 3.10 bytes per layer value, everything on disk counted: the
run of bench/long_run.py (realistic grad norms every step, activation abs-max every 10th),
shortened to 4,000 steps x 500 layers, stored through the real ingest path and judged by
the real worker into a SQLite file. What grows per batch beyond the compressed columns
(analysis queue rows left behind, rollups, summaries, combined-norm buckets, samples,
indexes) shows here, as it would on the 20,000 x 500 and 1,000,000 x 1,000 runs."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import numpy as np

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings
from tests.conftest import judged_client

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from long_run import (  # noqa: E402
    SAMPLE_EVERY,
    STEPS_PER_BATCH,
    TEMPLATES,
    body,
    layer_table,
    make_batches,
)

STEPS, LAYERS = 4_000, 500
MAX_BYTES_PER_VALUE = 3.10  # docs/benchmarks.md: 2.91 on bench/long_run.py's 20,000 x 500


def table_bytes(path: Path) -> dict[str, int]:
    """Bytes of each table and index of the SQLite file (its WAL included: read through
    SQLite's pager)."""
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"))


def test_a_long_wide_run_takes_at_most_3_10_bytes_per_layer_value(tmp_path: Path) -> None:
    path = tmp_path / "size.db"
    app = create_app(Settings(database_url=f"sqlite:///{path}"))
    templates = make_batches(LAYERS, np.random.default_rng(0))
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    batches = STEPS // STEPS_PER_BATCH
    halfway: dict[str, int] = {}
    try:
        with judged_client(app) as api:
            api.put("/api/v1/runs/long", json={"layers": layer_table(LAYERS)}
                    ).raise_for_status()
            for seq in range(batches):
                if seq == batches // 2:
                    halfway = table_bytes(path)
                api.post("/api/v1/runs/long/batches", headers=headers,
                         content=body(templates[seq % TEMPLATES], seq, LAYERS)
                         ).raise_for_status()
            run = api.get("/api/v1/runs/long").json()
            assert (run["last_step"], run["analysis_pending"]) == (STEPS - 1, 0)
    finally:
        close_app(app)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert db.execute("SELECT count(*) FROM analysis_queue").fetchone() == (0,)
    by_table = table_bytes(path)
    size = sum(p.stat().st_size for p in tmp_path.glob("size.db*"))
    values = STEPS * LAYERS + STEPS // SAMPLE_EVERY * LAYERS  # grad norms + activation abs-max
    assert size / values <= MAX_BYTES_PER_VALUE, sorted(by_table.items(), key=lambda t: -t[1])
    # beside the compressed columns, the second half of the run added (almost) nothing:
    # what the run keeps there is per run (its layers, rollups, empty tables), not per step
    grown = {name: n - halfway.get(name, 0) for name, n in by_table.items()
             if name != "batches" and n > halfway.get(name, 0)}
    assert sum(grown.values()) / (values / 2) < 0.02, grown
