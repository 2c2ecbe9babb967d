"""Many ranks into one run: 64 simulated ranks x 1,000 layers, 10 steps/s each, for 60 s,
into one Postgres database shared by two server processes.

Each simulated rank posts what the agent would: every `flush_interval` (2 s) a gzip
batch of the steps it took since the last one (20 at 10 steps/s), with per-step scalars;
under DDP (`--layout replicated`, the default) only rank 0 carries the 1,000 per-layer
grad norms, under FSDP (`--layout sharded`) every rank does. Ranks alternate between the
two servers. Reports committed steps/s, p50/p99 request latency, how late the senders
fell behind their schedule, page latency while ingesting and after, bytes stored per
step, and checks in the database that every step of every rank arrived exactly once.

    python bench/ranks.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/ranks.py --postgres ... --no-detect      # the same with detectors off
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psycopg

FLUSH_S = 2.0  # the agent's flush interval: one batch per rank every 2 s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(database_url: str, detect: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "AMPWATCH_DATABASE_URL": database_url,
           "AMPWATCH_ANALYSIS__ENABLED": "true" if detect else "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "ampwatch.server.app:create_app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def fresh_database(admin_url: str, prefix: str = "ampwatch_ranks") -> str:
    """A new empty database beside the one `admin_url` names; returns its SQLAlchemy URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return admin_url.rsplit("/", 1)[0] + "/" + name


def drop_database(admin_url: str, url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def layer_table(n_layers: int) -> list[dict]:
    return [{"index": i, "name": f"blocks.{i // 8}.l{i % 8}", "type": "Linear",
             "param_count": 512 * 512, "dtype": "float32",
             "attrs": {"in_features": 512, "out_features": 512}, "forward_index": i}
            for i in range(n_layers)]


def batch_body(rank: int, seq: int, first: int, count: int, n_layers: int, per_layer: bool,
               rng: random.Random) -> bytes:
    steps = []
    for step in range(first, first + count):
        record = {"step": step, "loss_scale": 65536.0, "scale_after": 65536.0,
                  "skipped": False, "grad_norm": 1.0 + rng.random(), "loss": 2.0,
                  "lr": 3e-4, "t_forward_ms": 30.0, "t_backward_ms": 55.0,
                  "t_optimizer_ms": 5.0, "t_step_ms": 100.0 + rng.random(),
                  "autocast_dtype": "float16"}
        if per_layer:
            record["layer_grad_norm"] = [round(rng.random(), 6) for _ in range(n_layers)]
        steps.append(record)
    return gzip.compress(json.dumps({"rank": rank, "seq": seq, "steps": steps}).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", required=True, help="an admin URL (CREATE DATABASE)")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0, help="steps/s of each rank")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--layout", choices=("replicated", "sharded"), default="replicated")
    parser.add_argument("--no-detect", action="store_true", help="detectors off (their cost)")
    args = parser.parse_args()

    url = fresh_database(args.postgres)
    first_proc, first_url = start_server(url, not args.no_detect)  # migrates the database
    procs, urls = [first_proc], [first_url]
    for _ in range(args.servers - 1):
        proc, server_url = start_server(url, not args.no_detect)
        procs.append(proc)
        urls.append(server_url)
    run_id = f"ranks-{uuid.uuid4().hex[:6]}"
    try:
        httpx.put(f"{urls[0]}/api/v1/runs/{run_id}", timeout=30, json={
            "name": run_id, "layers": layer_table(args.layers),
            "environment": {"world_size": args.ranks, "parallelism":
                            "ddp" if args.layout == "replicated" else "fsdp2",
                            "grad_layout": args.layout}}).raise_for_status()
        report(args, url, urls, run_id)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        drop_database(args.postgres, url)


def report(args: argparse.Namespace, db_url: str, urls: list[str], run_id: str) -> None:
    per_batch = round(args.rate * FLUSH_S)
    batches = int(args.seconds / FLUSH_S)
    latencies: list[float] = []
    late: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = time.monotonic() + 1.0
    headers = {"content-encoding": "gzip", "content-type": "application/json"}

    def rank_loop(rank: int) -> None:
        rng = random.Random(rank)
        offset = rank / args.ranks * FLUSH_S  # ranks' flushes spread over the interval
        per_layer = args.layout == "sharded" or rank == 0
        with httpx.Client(base_url=urls[rank % len(urls)], timeout=60) as client:
            for seq in range(batches):
                body = batch_body(rank, seq, seq * per_batch, per_batch, args.layers,
                                  per_layer, rng)
                due = start + offset + (seq + 1) * FLUSH_S
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sent = time.monotonic()
                for attempt in range(10):  # as the agent does: retry what did not commit
                    try:
                        reply = client.post(f"/api/v1/runs/{run_id}/batches", content=body,
                                            headers=headers)
                        status = reply.status_code
                    except httpx.TransportError as exc:
                        status = type(exc).__name__
                    if status == 200:
                        break
                    with lock:
                        failures.append(f"rank {rank} seq {seq} try {attempt}: {status}")
                    time.sleep(0.5)
                took = time.monotonic() - sent
                with lock:
                    latencies.append(took)
                    late.append(max(0.0, sent - due))

    page_times: dict[str, list[float]] = {}
    stop = threading.Event()

    def pages_loop() -> None:
        paths = {f"run page ({args.ranks}-rank panel)": f"/runs/{run_id}",
                 "run page, one rank": f"/runs/{run_id}?rank=0",
                 "ranks API": f"/api/v1/runs/{run_id}/ranks",
                 "combined norms, 200 steps x layers":
                     f"/api/v1/runs/{run_id}/grad_norms?layers=true&limit=200"}
        with httpx.Client(base_url=urls[0], timeout=60) as client:
            while not stop.wait(3.0):
                for name, path in paths.items():
                    t0 = time.monotonic()
                    client.get(path).raise_for_status()
                    page_times.setdefault(name, []).append(time.monotonic() - t0)

    load_before = os.getloadavg()
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(args.ranks)]
    pager = threading.Thread(target=pages_loop)
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    pager.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - max(t0, start)
    stop.set()
    pager.join()
    load_after = os.getloadavg()

    total_steps = args.ranks * batches * per_batch
    lat = sorted(latencies)
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
    print(f"{args.ranks} ranks x {args.layers} layers, {args.rate:g} steps/s each, "
          f"{args.seconds:g} s, {len(urls)} servers, layout {args.layout}, detectors "
          f"{'off' if args.no_detect else 'on'}; load "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"offered {args.ranks * args.rate:g} steps/s; committed {total_steps} steps in "
          f"{elapsed:.1f} s = {total_steps / elapsed:,.0f} steps/s; failed attempts "
          f"{len(failures)} (retried)")
    print(f"request latency p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, max {lat[-1]*1000:.0f} ms;"
          f" senders behind schedule: median {statistics.median(late)*1000:.0f} ms, "
          f"max {max(late)*1000:.0f} ms")
    for name, times in page_times.items():
        print(f"page during ingest: {name}: median {statistics.median(times)*1000:.0f} ms, "
              f"max {max(times)*1000:.0f} ms ({len(times)} reads)")
    with httpx.Client(base_url=urls[1 % len(urls)], timeout=60) as client:
        for path in (f"/runs/{run_id}", f"/api/v1/runs/{run_id}/ranks"):
            times = []
            for _ in range(5):
                t1 = time.monotonic()
                client.get(path).raise_for_status()
                times.append(time.monotonic() - t1)
            print(f"page after ingest: {path}: median {statistics.median(times)*1000:.0f} ms")
    check_once(db_url, run_id, args.ranks, batches, per_batch)
    for failure in failures[:5]:
        print("FAILED", failure)


def check_once(db_url: str, run_id: str, ranks: int, batches: int, per_batch: int) -> None:
    """Every rank's steps 0..N-1 stored exactly once, and the bytes they take."""
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        rows = conn.execute(
            "SELECT rank, count(*), sum(n_steps), min(first_step), max(last_step), "
            "sum(octet_length(scalars) + octet_length(present) "
            "+ coalesce(octet_length(layer_grad), 0)) FROM batches WHERE run_id = %s "
            "GROUP BY rank ORDER BY rank", (run_id,)).fetchall()
        overlaps = conn.execute(
            "SELECT count(*) FROM batches a JOIN batches b ON a.run_id = b.run_id "
            "AND a.rank = b.rank AND a.seq < b.seq AND a.last_step >= b.first_step "
            "AND a.first_step <= b.last_step WHERE a.run_id = %s", (run_id,)).fetchone()[0]
        table_bytes = conn.execute(
            "SELECT pg_total_relation_size('batches')").fetchone()[0]
    expected = batches * per_batch
    complete = [r for r in rows if r[1] == batches and r[2] == expected
                and r[3] == 0 and r[4] == expected - 1]
    steps = sum(r[2] for r in rows)
    payload = sum(r[5] for r in rows)
    print(f"every step once: {len(complete)} of {ranks} ranks hold steps 0..{expected - 1} in "
          f"{batches} batches, {overlaps} overlapping batches, {steps} steps stored")
    print(f"bytes per step (all ranks' records of one step): packed columns "
          f"{payload / (steps / ranks):,.0f} B, batches table with indexes and TOAST "
          f"{table_bytes / (steps / ranks):,.0f} B")


if __name__ == "__main__":
    main()
