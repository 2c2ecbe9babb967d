"""The run page of a many-rank run, while it ingests: 1,024 ranks x 1,000 layers by default.

Starts a real server (a SQLite file, or a fresh Postgres database with --postgres),
registers one DDP run of `--ranks` ranks (rank 0 carries the 1,000 per-layer grad norms,
bench/ranks.py's batches), loads `--batches` batches of 20 steps per rank, then keeps
ingesting the next batches round by round at `--rate` batches/s from one sender while it
times each read `--repeats` times: the run page as HTML and as its JSON twin, `/ranks`
and the combined grad norms. Prints p50 and p99 per read, the ingest it kept up, and
the load average (the numbers are only comparable at the same load). With `--layout
sharded` the run is FSDP's: a combined grad norm sums every rank's, from the rollup the
analysis worker keeps (server/store/combined.py), so the detectors run too.

    python bench/rank_pages.py                      # ~2 minutes, most of it loading
    python bench/rank_pages.py --ranks 64 --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/rank_pages.py --layout sharded
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from ingest import start_server
from ranks import batch_body, drop_database, fresh_database, layer_table

STEPS = 20  # per batch: 2 s of a 10 steps/s rank
HEADERS = {"content-encoding": "gzip", "content-type": "application/json"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=3, help="per rank, before timing")
    parser.add_argument("--rate", type=float, default=50.0, help="batches/s while timing")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--postgres", help="an admin URL (CREATE DATABASE); else SQLite")
    parser.add_argument("--layout", choices=("replicated", "sharded"), default="replicated",
                        help="sharded (FSDP): a combined norm sums every rank's; its rollup "
                             "is kept by the worker, so the detectors run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = (fresh_database(args.postgres) if args.postgres
               else f"sqlite:///{Path(tmp) / 'ranks.db'}")
        proc, server = start_server(url, detect=args.layout == "sharded")
        try:
            run(args, server)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            if args.postgres:
                drop_database(args.postgres, url)


def run(args: argparse.Namespace, server: str) -> None:
    run_id = f"ranks-{uuid.uuid4().hex[:6]}"
    httpx.put(f"{server}/api/v1/runs/{run_id}", timeout=60, json={
        "name": run_id, "layers": layer_table(args.layers),
        "environment": {"world_size": args.ranks,
                        "parallelism": "ddp" if args.layout == "replicated" else "fsdp2",
                        "grad_layout": args.layout}}).raise_for_status()
    rng = random.Random(0)

    def body(rank: int, seq: int) -> bytes:
        return batch_body(rank, seq, seq * STEPS, STEPS, args.layers, rank == 0, rng)

    t0 = time.perf_counter()
    with httpx.Client(base_url=server, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        for seq in range(args.batches):
            list(pool.map(lambda rank, seq=seq: post(http, run_id, body(rank, seq)),
                          range(args.ranks)))
    print(f"loaded {args.ranks:,} ranks x {args.batches} batches of {STEPS} steps in "
          f"{time.perf_counter() - t0:.0f} s")

    stop = threading.Event()
    sent: list[int] = []
    sender = threading.Thread(target=ingest, args=(server, run_id, args, body, stop, sent))
    sender.start()
    try:
        reads = {"run page (HTML)": f"/runs/{run_id}",
                 "run page (JSON twin)": f"/runs/{run_id}?format=json",
                 "/ranks": f"/api/v1/runs/{run_id}/ranks",
                 "combined grad norms": f"/api/v1/runs/{run_id}/grad_norms"}
        started = time.monotonic()
        rows = [(name, *timed(server, path, args.repeats)) for name, path in reads.items()]
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        sender.join()
    print(f"\nwhile ingesting {len(sent) / elapsed:.1f} batches/s (offered {args.rate:g}); "
          f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    print(f"{'read':<24}{'p50 ms':>10}{'p99 ms':>10}{'bytes':>12}")
    for name, p50, p99, size in rows:
        print(f"{name:<24}{p50 * 1000:>10.0f}{p99 * 1000:>10.0f}{size:>12,}")


def post(http: httpx.Client, run_id: str, body: bytes) -> None:
    http.post(f"/api/v1/runs/{run_id}/batches", content=body,
              headers=HEADERS).raise_for_status()


def ingest(server: str, run_id: str, args: argparse.Namespace, body, stop: threading.Event,
           sent: list[int]) -> None:
    """The next batches of every rank, round by round, at `args.rate` batches/s."""
    seq, rank, next_at = args.batches, 0, time.monotonic()
    with httpx.Client(base_url=server, timeout=120) as http:
        while not stop.is_set():
            post(http, run_id, body(rank, seq))
            sent.append(rank)
            rank = (rank + 1) % args.ranks
            seq += rank == 0
            next_at += 1 / args.rate
            time.sleep(max(0.0, next_at - time.monotonic()))


def timed(server: str, path: str, repeats: int) -> tuple[float, float, int]:
    """(p50, p99 seconds, body bytes) of `repeats` GETs after one warm-up."""
    with httpx.Client(base_url=server, timeout=120) as http:
        size = len(http.get(path).raise_for_status().content)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            http.get(path).raise_for_status()
            times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, round(0.99 * len(times)))], size


if __name__ == "__main__":
    main()
