"""What detection on ingest costs: an in-process A/B of the same batches posted to two
apps, detectors off (A) and on (B).

Each app has its own temp SQLite file and a FastAPI TestClient (no network, no server
process, so the difference is the detectors' own work). Both register bench/ingest.py's
200-layer run and receive its agent-shaped batches (100 steps, per-layer grad norms,
activation samples every 10 steps), the same bodies in the same order. Batches alternate
A, B, B, A, ... so that noise from other processes on a shared machine falls on both.
The first `--warmup` batches per app fill the detectors' 500-step history and are not
timed. Each round times `--batches` batches per app: process CPU ms per batch (wall
ms too) and the ratio on/off; the summary is the median over rounds.

    python bench/detect_cost.py                  # 5 rounds x 30 batches, ~30 s
    python bench/detect_cost.py --rounds 9 --batches 50
"""

from __future__ import annotations

import argparse
import gzip
import random
import statistics
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from ingest import layer_table, make_template

from ampwatch.server.analysis import AnalysisSettings
from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings

RUN_ID = "detect-cost"
STEPS_PER_BATCH = 100  # the size the recorded figures were measured with
HEADERS = {"content-encoding": "gzip", "content-type": "application/json"}


def bodies(count: int) -> list[bytes]:
    """`count` consecutive gzip batches of rank 0 (built before any timing)."""
    rng = random.Random(0)
    templates = [make_template(rng, STEPS_PER_BATCH) for _ in range(10)]
    return [gzip.compress(templates[seq % len(templates)] % {
        b"rank": 0, b"seq": seq,
        **{b"s%d" % i: seq * STEPS_PER_BATCH + i for i in range(STEPS_PER_BATCH)}}, 1)
        for seq in range(count)]


def client(folder: Path, detect: bool) -> TestClient:
    settings = Settings(database_url=f"sqlite:///{folder / f'detect-{detect}.db'}",
                        analysis=AnalysisSettings(enabled=detect))
    api = TestClient(create_app(settings))
    api.put(f"/api/v1/runs/{RUN_ID}", json={"layers": layer_table()}).raise_for_status()
    return api


def post(api: TestClient, body: bytes) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ingest request."""
    cpu, wall = time.process_time(), time.perf_counter()
    api.post(f"/api/v1/runs/{RUN_ID}/batches", content=body,
             headers=HEADERS).raise_for_status()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=30, help="timed batches per app per round")
    parser.add_argument("--warmup", type=int, default=6, help="untimed batches per app first")
    args = parser.parse_args()

    payloads = bodies(args.warmup + args.rounds * args.batches)
    with tempfile.TemporaryDirectory(prefix="ampwatch-detect-") as tmp:
        apps = {False: client(Path(tmp), False), True: client(Path(tmp), True)}
        for body in payloads[: args.warmup]:
            for api in apps.values():
                post(api, body)
        print(f"{'round':>5} {'off cpu ms':>10} {'on cpu ms':>10} {'ratio':>6} "
              f"{'off wall ms':>11} {'on wall ms':>11} {'ratio':>6}")
        ratios, wall_ratios, off_ms, on_ms = [], [], [], []
        for r in range(args.rounds):
            totals = {False: [0.0, 0.0], True: [0.0, 0.0]}
            start = args.warmup + r * args.batches
            for i, body in enumerate(payloads[start: start + args.batches]):
                for detect in (False, True) if i % 2 == 0 else (True, False):
                    cpu, wall = post(apps[detect], body)
                    totals[detect][0] += cpu
                    totals[detect][1] += wall
            (off_cpu, off_wall), (on_cpu, on_wall) = (
                [1000 * t / args.batches for t in totals[d]] for d in (False, True))
            ratios.append(on_cpu / off_cpu)
            wall_ratios.append(on_wall / off_wall)
            off_ms.append(off_cpu)
            on_ms.append(on_cpu)
            print(f"{r + 1:>5} {off_cpu:>10.2f} {on_cpu:>10.2f} {on_cpu / off_cpu:>6.3f} "
                  f"{off_wall:>11.2f} {on_wall:>11.2f} {on_wall / off_wall:>6.3f}", flush=True)
        for api in apps.values():
            api.close()
    print(f"median: off {statistics.median(off_ms):.2f} ms, on {statistics.median(on_ms):.2f} "
          f"ms CPU per batch; on/off {statistics.median(ratios):.3f} CPU, "
          f"{statistics.median(wall_ratios):.3f} wall")


if __name__ == "__main__":
    main()
