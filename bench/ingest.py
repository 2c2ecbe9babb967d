"""Ingest rate and long-run query latency of a real ampwatch server over HTTP.

Starts the server under uvicorn, one process (a SQLite file; `--postgres URL` adds
Postgres), registers runs with 200 layers, and sends agent-shaped gzip batches (200 steps
each, as the agent cuts them at high step rates; per-step scalars, per-layer grad norms,
activation samples every 10 steps) from 1..8 concurrent senders. Reports committed
steps/s and layer-values/s and p50/p99 request latency, then times the reads of a
100,000-step x 200-layer run: steps downsampled to 2,000 points and a 200 x 1,000
heatmap matrix.

    python bench/ingest.py                      # SQLite, ~2 minutes
    python bench/ingest.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/ingest.py --no-detect          # the same with detectors off (their cost)
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
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

LAYERS = 200
# the agent cuts a batch at max_batch_steps (200) or every 2 s: at thousands of steps/s
# every batch is full; --steps-per-batch 100 shows smaller ones
STEPS_PER_BATCH = 200
SAMPLE_EVERY = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(database_url: str, detect: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "AMPWATCH_DATABASE_URL": database_url,
           "AMPWATCH_ANALYSIS__ENABLED": "true" if detect else "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "ampwatch.server.app:create_app",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


PARTS = ("q", "k", "v", "o", "fc1", "fc2", "ln1", "ln2")


def layer_table() -> list[dict]:
    return [{"index": i, "name": f"blocks.{i // 8}.{PARTS[i % 8]}",
             "type": "Linear", "param_count": 256 * 256, "dtype": "float32",
             "attrs": {"in_features": 256, "out_features": 256}, "forward_index": i}
            for i in range(LAYERS)]


def make_template(rng: random.Random, steps_per_batch: int = STEPS_PER_BATCH) -> bytes:
    """An agent-shaped batch as JSON bytes with rank, seq and step placeholders."""
    steps = []
    scale = 65536.0
    for offset in range(steps_per_batch):
        skipped = rng.random() < 0.002
        record = {
            "step": f"@STEP{offset}@", "loss_scale": scale,
            "scale_after": scale / 2 if skipped else scale,
            "skipped": skipped, "grad_norm": "Infinity" if skipped else rng.uniform(0.5, 3),
            "loss": rng.uniform(1, 4), "lr": 3e-4, "t_forward_ms": rng.uniform(40, 45),
            "t_backward_ms": rng.uniform(80, 90), "t_optimizer_ms": rng.uniform(8, 10),
            "t_step_ms": rng.uniform(130, 145), "peak_mem_bytes": 1.2e9,
            "autocast_dtype": "float16", "scheduler_steps": 1, "scaler_updates": 1,
            "layer_grad_norm": [rng.uniform(1e-4, 1.0) for _ in range(LAYERS)],
        }
        if offset % SAMPLE_EVERY == 0:
            record["activations"] = {
                "absmax": [rng.uniform(0.1, 500.0) for _ in range(LAYERS)],
                "dtype": ["float16"] * LAYERS,
                "time_ms": [rng.uniform(0.05, 0.5) for _ in range(LAYERS)],
            }
        steps.append(record)
    text = json.dumps({"rank": "@RANK@", "seq": "@SEQ@", "steps": steps}).replace("%", "%%")
    text = text.replace('"@RANK@"', "%(rank)d").replace('"@SEQ@"', "%(seq)d")
    for offset in range(steps_per_batch):
        text = text.replace(f'"@STEP{offset}@"', f"%(s{offset})d")
    return text.encode()


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) the process `pid` has used; 0 where /proc does not tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ingest(url: str, run_id: str, senders: int, steps_per_sender: int,
           steps_per_batch: int = STEPS_PER_BATCH, server_pid: int | None = None) -> dict:
    """Each sender is one rank streaming its batches in order; returns rates, and the
    server's CPU a batch (its analysis thread's included) when `server_pid` is given."""
    httpx.put(f"{url}/api/v1/runs/{run_id}", json={"layers": layer_table()},
              timeout=60).raise_for_status()
    batches = steps_per_sender // steps_per_batch
    rng = random.Random(0)
    templates = [make_template(rng, steps_per_batch) for _ in range(10)]
    # payloads are built before the clock starts: the agent does that on its own thread
    payloads = {rank: [gzip.compress(templates[seq % len(templates)] % {
        b"rank": rank, b"seq": seq,
        **{b"s%d" % i: seq * steps_per_batch + i for i in range(steps_per_batch)}}, 1)
        for seq in range(batches)] for rank in range(senders)}
    headers = {"content-encoding": "gzip", "content-type": "application/json"}

    def send(rank: int) -> list[float]:
        latencies = []
        with httpx.Client(base_url=url, timeout=120) as http:
            for body in payloads[rank]:
                t0 = time.perf_counter()
                response = http.post(f"/api/v1/runs/{run_id}/batches", content=body,
                                     headers=headers)
                latencies.append(time.perf_counter() - t0)
                response.raise_for_status()
        return latencies

    cpu0 = cpu_seconds(server_pid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(senders) as pool:
        latencies = [lat for result in pool.map(send, range(senders)) for lat in result]
    elapsed = time.perf_counter() - t0
    deadline = time.monotonic() + 60
    run = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=60).json()
    while run.get("analysis_pending") and time.monotonic() < deadline:  # its CPU counts
        time.sleep(0.05)
        run = httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=60).json()
    cpu = cpu_seconds(server_pid) - cpu0
    assert run["steps"] == senders * batches * steps_per_batch, run["steps"]
    latencies.sort()
    return {
        "senders": senders,
        "steps": run["steps"],
        "seconds": elapsed,
        "steps_per_s": run["steps"] / elapsed,
        "layer_values_per_s": run["steps"] * LAYERS / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "server_cpu_ms": 1000 * cpu / (senders * batches),
    }


def time_get(url: str, path: str, repeats: int = 7) -> tuple[float, float]:
    """(median, best) seconds of a GET, after one warm-up."""
    with httpx.Client(base_url=url, timeout=120) as http:
        http.get(path).raise_for_status()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            http.get(path).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", help="also run on this Postgres URL (a fresh schema)")
    parser.add_argument("--long-steps", type=int, default=100_000)
    parser.add_argument("--steps-per-sender", type=int, default=10_000)
    parser.add_argument("--senders", default="1,2,4,8")
    parser.add_argument("--steps-per-batch", type=int, default=STEPS_PER_BATCH)
    parser.add_argument("--no-detect", action="store_true", help="detectors off")
    args = parser.parse_args()

    targets = []
    tmp = tempfile.TemporaryDirectory(prefix="ampwatch-bench-")
    targets.append(("sqlite", f"sqlite:///{Path(tmp.name) / 'bench.db'}"))
    if args.postgres:
        targets.append(("postgres", _fresh_postgres(args.postgres)))
    try:
        run_targets(targets, args)
    finally:
        tmp.cleanup()
        if args.postgres:
            _drop_postgres(targets[-1][1])


def run_targets(targets: list[tuple[str, str]], args: argparse.Namespace) -> None:

    for backend, database_url in targets:
        proc, url = start_server(database_url, detect=not args.no_detect)
        try:
            print(f"\n## {backend} (detectors {'off' if args.no_detect else 'on'}, "
                  f"{args.steps_per_batch} steps per batch)")
            print(f"{'senders':>7} {'steps':>8} {'steps/s':>9} {'values/s':>11} "
                  f"{'p50 ms':>7} {'p99 ms':>7} {'server CPU ms/batch':>19}")
            for senders in [int(s) for s in args.senders.split(",")]:
                r = ingest(url, f"ingest-{senders}-{uuid.uuid4().hex[:6]}", senders,
                           args.steps_per_sender, args.steps_per_batch, server_pid=proc.pid)
                print(f"{r['senders']:>7} {r['steps']:>8} {r['steps_per_s']:>9.0f} "
                      f"{r['layer_values_per_s']:>11.0f} {r['p50_ms']:>7.1f} "
                      f"{r['p99_ms']:>7.1f} {r['server_cpu_ms']:>19.1f}", flush=True)
            long = ingest(url, "long-run", 1, args.long_steps, args.steps_per_batch)
            print(f"long run: {long['steps']} steps x {LAYERS} layers ingested at "
                  f"{long['steps_per_s']:.0f} steps/s")
            for label, path in [
                ("steps, max_points=2000", "/api/v1/runs/long-run/steps?max_points=2000"),
                ("matrix 200 x 1000", "/api/v1/runs/long-run/layers/matrix?buckets=1000"),
                ("layer series, 2000 pts", "/api/v1/runs/long-run/layers/7/series"
                                            "?max_points=2000"),
                ("run", "/api/v1/runs/long-run"),
            ]:
                median, best = time_get(url, path)
                print(f"  GET {label:<24} median {1000 * median:7.1f} ms  best "
                      f"{1000 * best:7.1f} ms")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _fresh_postgres(url: str) -> str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin_url = make_url(url).set(drivername="postgresql+psycopg")
    name = f"ampwatch_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return admin_url.set(database=name).render_as_string(hide_password=False)


def _drop_postgres(url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)'))
    admin.dispose()


if __name__ == "__main__":
    main()
