"""The project view at 1,000 runs: `GET /api/v1/projects/{project}/health` and the page.

Creates a SQLite database through the server's own app (migrations), then stores 1,000
runs of one project in it through the ORM models: each with a sweep's config (lr, warmup,
batch size, dtype, seed, optimizer), an agent-shaped environment, a rank row with its
steps, and findings: runs at lr >= 0.1 a critical non-finite loss and a loss-scale
warning, about one run in five an info note. Then times the API, its page and the
page's JSON twin: median and best of 7 in-process GETs after one warm-up, and the SQL
statements each answer ran (a count that grows with the runs would be an N+1).

    python bench/project_health.py               # ~30 s
    python bench/project_health.py --runs 5000
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import event

from ampwatch.server.app import close_app, create_app
from ampwatch.server.models import Finding, Run, RunRank, utcnow
from ampwatch.server.settings import Settings

TARGET_S = 1.0
PROJECT = "sweep"
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)
STEPS = 2_000


def fill(session, runs: int) -> None:
    """`runs` runs of PROJECT, their rank rows and findings, in three bulk inserts."""
    rng = random.Random(0)
    now = utcnow()
    run_rows, rank_rows, findings = [], [], []
    for i in range(runs):
        run_id, lr = f"run-{i:05d}", LRS[i % len(LRS)]
        dtype = rng.choice(("bf16", "fp16"))
        run_rows.append({
            "id": run_id, "name": run_id, "project": PROJECT, "tags": ["sweep-1"],
            "config": {"lr": lr, "warmup": int(lr * 1e5), "batch_size": rng.choice((32, 64)),
                       "dtype": dtype, "seed": i % 10,
                       "optimizer": {"name": "adamw", "betas": [0.9, 0.999]}},
            "environment": {"torch_version": "2.13.0", "python_version": "3.11.7",
                            "device": "cuda:0", "device_name": "NVIDIA H100",
                            "autocast_dtype": "float16" if dtype == "fp16" else "bfloat16",
                            "world_size": 8, "hostname": f"node-{rng.randrange(16)}"},
            "status": "critical" if lr >= 0.1 else "healthy", "open_findings": 0,
            "n_layers": 48, "created_at": now, "updated_at": now})
        rank_rows.append({"run_id": run_id, "rank": 0, "batches": STEPS // 100,
                          "max_seq": STEPS // 100 - 1, "steps": STEPS, "last_step": STEPS - 1,
                          "last_seen_at": now, "finished_at": now})
        if lr >= 0.1:
            bad = rng.randrange(50, 500)
            findings += [
                _finding(run_id, "nonfinite", "critical", bad, {"cause": "nonfinite_loss"}),
                _finding(run_id, "scaler_divergence", "warning", bad + 3,
                         {"code": "scale_collapse"}, code="scale_collapse")]
        elif rng.random() < 0.2:
            findings.append(_finding(run_id, "pitfall", "info", 0, {}, code="no_clip"))
    session.bulk_insert_mappings(Run, run_rows)
    session.bulk_insert_mappings(RunRank, rank_rows)
    session.bulk_insert_mappings(Finding, findings)
    session.commit()


def _finding(run_id: str, kind: str, severity: str, step: int, evidence: dict,
             code: str | None = None) -> dict:
    return {"run_id": run_id, "rank": 0, "kind": kind, "code": code,
            "key": f"{kind}:{code}", "severity": severity, "status": "open", "step": step,
            "last_step": step + 10, "message": f"{kind} from step {step}",
            "evidence": evidence, "count": 1, "created_at": utcnow(), "updated_at": utcnow()}


def time_get(client: TestClient, path: str, statements: list[str]) -> tuple[float, float, int, int]:
    """Median and best seconds of 7 GETs after a warm-up, the body's bytes and the SQL
    statements one GET ran."""
    assert client.get(path).status_code == 200
    times = []
    for _ in range(7):
        statements.clear()
        start = time.perf_counter()
        response = client.get(path)
        times.append(time.perf_counter() - start)
        assert response.status_code == 200, response.text[:200]
    return statistics.median(times), min(times), len(response.content), len(statements)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ampwatch-bench-project-") as tmp:
        app = create_app(Settings(database_url=f"sqlite:///{Path(tmp) / 'bench.db'}",
                                  embedded_worker=False))
        try:
            with app.state.sessionmaker() as session:
                engine = session.get_bind()
                fill(session, args.runs)
            statements: list[str] = []
            event.listen(engine, "before_cursor_execute",
                         lambda conn, cursor, statement, *rest: statements.append(statement))
            with TestClient(app, base_url="http://127.0.0.1") as client:
                body = client.get(f"/api/v1/projects/{PROJECT}/health").json()
                top = body["factors"][0]
                print(f"{len(body['runs']):,} runs, {body['unhealthy']} unhealthy, "
                      f"{len(body['factors'])} keys; first: {top['summary']} "
                      f"({top['verdict']})\n")
                print(f"| {'answer':<18} | {'median ms':>9} | {'best ms':>7} | {'KiB':>5} | "
                      f"{'SQL statements':>14} |")
                print(f"|{'-' * 20}|{'-' * 11}|{'-' * 9}|{'-' * 7}|{'-' * 16}|")
                worst = 0.0
                for name, path in (("API", f"/api/v1/projects/{PROJECT}/health"),
                                   ("page (HTML)", f"/projects/{PROJECT}"),
                                   ("page's JSON twin", f"/projects/{PROJECT}?format=json")):
                    median, best, size, count = time_get(client, path, statements)
                    worst = max(worst, median)
                    print(f"| {name:<18} | {1000 * median:>9.0f} | {1000 * best:>7.0f} | "
                          f"{size / 1024:>5.0f} | {count:>14} |", flush=True)
            verdict = "within" if worst < TARGET_S else "OVER"
            print(f"\nslowest median {1000 * worst:.0f} ms: {verdict} the {TARGET_S:g} s target")
        finally:
            close_app(app)


if __name__ == "__main__":
    main()
