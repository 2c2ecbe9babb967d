"""What the analysis worker costs per batch, and what its in-memory windows save.

Posts `--batches` agent-shaped batches per rank (bench/ingest.py's 200-layer run, 20
steps each, activation samples every 10 steps; the last rank skips every step of its
middle fifth) of `--ranks` ranks, round-robin, into an
app whose worker is off (ingest alone: CPU ms per batch). Then drains the queue with one
worker three ways, each from the same queued tasks: windows held in memory (the worker
as it runs), windows dropped before every batch (every batch re-reads its rank's
history, as the request did before issue 31), and a worker killed and restarted halfway
(the windows rebuilt from storage). Prints CPU ms per batch for each and checks that all
three wrote the same findings.

    python bench/worker_drain.py                          # SQLite, a temp file
    python bench/worker_drain.py --ranks 8 --batches 60 \\
        --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import delete, insert, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import _drop_postgres, _fresh_postgres, layer_table, make_template  # noqa: E402

from ampwatch.server.analysis.window_cache import RankWindows  # noqa: E402
from ampwatch.server.analysis_worker import AnalysisWorker  # noqa: E402
from ampwatch.server.app import close_app, create_app  # noqa: E402
from ampwatch.server.models import AnalysisTask, Finding  # noqa: E402
from ampwatch.server.settings import Settings  # noqa: E402

RUN_ID = "worker-drain"
STEPS = 20
HEADERS = {"content-encoding": "gzip", "content-type": "application/json"}


def bodies(ranks: int, batches: int) -> list[bytes]:
    """Round-robin batches of every rank; the last rank skips every step of its middle
    fifth of batches (so the detectors have findings to agree on)."""
    rng = random.Random(0)
    templates = [make_template(rng, STEPS) for _ in range(5)]
    skipping = templates[0].replace(b'"skipped": false', b'"skipped": true')

    def template(rank: int, seq: int) -> bytes:
        if rank == ranks - 1 and 2 * batches // 5 <= seq < 3 * batches // 5:
            return skipping
        return templates[(seq + rank) % len(templates)]

    return [gzip.compress(template(rank, seq) % {
        b"rank": rank, b"seq": seq, **{b"s%d" % i: seq * STEPS + i for i in range(STEPS)}}, 1)
        for seq in range(batches) for rank in range(ranks)]


def findings(maker) -> list[tuple]:
    with maker() as session:
        return sorted(tuple(r) for r in session.execute(select(
            Finding.rank, Finding.key, Finding.severity, Finding.status, Finding.step,
            Finding.last_step, Finding.count)))


def drain(worker: AnalysisWorker, *, cold: bool, restart_at: int | None = None) -> float:
    """CPU seconds to drain the queue one batch per claim."""
    start, judged = time.process_time(), 0
    while True:
        if cold or judged == restart_at:
            worker.windows = RankWindows(worker.settings.worker_window_bytes)
        if not worker.drain_once():
            return time.process_time() - start
        judged += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batches", type=int, default=60, help="per rank")
    parser.add_argument("--postgres", help="admin URL of a Postgres server to use")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        url = (_fresh_postgres(args.postgres) if args.postgres
               else f"sqlite:///{Path(folder) / 'drain.db'}")
        try:
            run(url, args)
        finally:
            if args.postgres:
                _drop_postgres(url)


def run(url: str, args: argparse.Namespace) -> None:
    settings = Settings(database_url=url, embedded_worker=False, analysis_wait_s=0,
                        allowed_hosts="testserver")
    app = create_app(settings)
    maker = app.state.sessionmaker
    posts = bodies(args.ranks, args.batches)
    with TestClient(app) as api:
        api.put(f"/api/v1/runs/{RUN_ID}", json={
            "layers": layer_table(), "environment": {"world_size": args.ranks}},
        ).raise_for_status()
        start = time.process_time()
        for body in posts:
            api.post(f"/api/v1/runs/{RUN_ID}/batches", content=body,
                     headers=HEADERS).raise_for_status()
        ingest_s = time.process_time() - start
    with maker() as session:
        tasks = [{c.key: getattr(t, c.key) for c in AnalysisTask.__table__.columns}
                 for t in session.scalars(select(AnalysisTask).order_by(AnalysisTask.id))]
    n = len(tasks)
    rows = [("ingest, worker off", ingest_s)]
    results = []
    for label, cold, restart_at in (("drain, windows in memory", False, None),
                                    ("drain, history re-read per batch", True, None),
                                    ("drain, worker restarted halfway", False, n // 2)):
        with maker() as session:  # the same tasks again, the findings from scratch
            session.execute(delete(AnalysisTask))
            session.execute(delete(Finding))
            session.execute(insert(AnalysisTask), tasks)
            session.commit()
        worker = AnalysisWorker(maker, settings, claim_size=1)
        rows.append((label, drain(worker, cold=cold, restart_at=restart_at)))
        results.append(findings(maker))
    close_app(app)
    print(f"{args.ranks} ranks x {args.batches} batches of {STEPS} steps, "
          f"{len(layer_table())} layers ({url.split(':')[0]})")
    print(f"{'':36} {'CPU ms/batch':>12}")
    for label, seconds in rows:
        print(f"{label:36} {seconds * 1000 / n:12.1f}")
    same = all(r == results[0] for r in results)
    print(f"same findings all three ways: {same} ({len(results[0])} findings)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
