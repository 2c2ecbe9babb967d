"""A long, wide run through the real ingest path: ingest rate, bytes on disk per layer
value, and page latency from a cold server process.

Builds one run of --steps steps x --layers layers (per-layer grad norms every step,
activation samples every 10 steps, as the agent sends them) from one sender over HTTP
into a real server (uvicorn, detectors on), with realistic grad norms (a log-normal level
per layer, drifting noise per step: what the storage codec sees in real runs). Then it
restarts the server and times the run's pages and API reads, cold (first request) and
warm (median of 5).

    python bench/long_run.py --steps 100000 --layers 1000          # SQLite
    python bench/long_run.py --steps 100000 --layers 1000 \\
        --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import gzip
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import _drop_postgres, _fresh_postgres, start_server  # noqa: E402

STEPS_PER_BATCH = 200
SAMPLE_EVERY = 10
TEMPLATES = 16


def layer_table(layers: int) -> list[dict]:
    return [{"index": i, "name": f"blocks.{i // 8}.l{i % 8}", "type": "Linear",
             "param_count": 1024 * 1024, "attrs": {"in_features": 1024, "out_features": 1024},
             "forward_index": i} for i in range(layers)]


def make_batches(layers: int, rng: np.random.Generator) -> list[dict]:
    """Templates of one batch's per-layer blocks (the step numbers are set per batch)."""
    level = np.exp(rng.normal(-3, 1.5, layers))
    out = []
    for _ in range(TEMPLATES):
        norms = (level * np.exp(rng.normal(0, 0.1, (STEPS_PER_BATCH, layers)))).astype(np.float32)
        acts = (level * 1e3 * np.exp(rng.normal(0, 0.1, (STEPS_PER_BATCH // SAMPLE_EVERY,
                                                         layers)))).astype(np.float32)
        out.append({"norms": norms.astype(np.float64), "acts": acts.astype(np.float64)})
    return out


def body(template: dict, seq: int, layers: int) -> bytes:
    first = seq * STEPS_PER_BATCH
    steps = []
    for i in range(STEPS_PER_BATCH):
        step = {"step": first + i, "loss_scale": 65536.0, "scale_after": 65536.0,
                "skipped": False, "grad_norm": 1.0 + (i % 7) / 10, "loss": 2.5 - i * 1e-4,
                "lr": 3e-4, "t_step_ms": 140.0, "autocast_dtype": "float16",
                "layer_grad_norm": template["norms"][i]}
        if i % SAMPLE_EVERY == 0:
            step["activations"] = {"absmax": template["acts"][i // SAMPLE_EVERY],
                                   "dtype": ["float16"] * layers}
        steps.append(step)
    return gzip.compress(orjson.dumps({"rank": 0, "seq": seq, "steps": steps},
                                      option=orjson.OPT_SERIALIZE_NUMPY), 1)


def ingest(url: str, run_id: str, steps: int, layers: int) -> dict:
    """One sender streams the run; bodies are built on another thread (as the agent
    does) and that time is not counted."""
    httpx.put(f"{url}/api/v1/runs/{run_id}", json={"layers": layer_table(layers)},
              timeout=120).raise_for_status()
    templates = make_batches(layers, np.random.default_rng(0))
    batches = steps // STEPS_PER_BATCH
    ready: queue.Queue = queue.Queue(maxsize=4)

    def produce() -> None:
        for seq in range(batches):
            ready.put(body(templates[seq % TEMPLATES], seq, layers))

    threading.Thread(target=produce, daemon=True).start()
    latencies, sending = [], 0.0
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=300) as http:
        for seq in range(batches):
            payload = ready.get()
            t0 = time.perf_counter()
            http.post(f"/api/v1/runs/{run_id}/batches", content=payload,
                      headers=headers).raise_for_status()
            latencies.append(time.perf_counter() - t0)
            sending += latencies[-1]
            if seq % max(1, batches // 10) == 0:
                print(f"  ingested {seq * STEPS_PER_BATCH:,} of {steps:,} steps", flush=True)
    head, tail = latencies[:20], latencies[-20:]
    return {"steps": batches * STEPS_PER_BATCH, "seconds": sending,
            "values_per_s": batches * STEPS_PER_BATCH * layers / sending,
            "first_ms": 1000 * statistics.median(head), "last_ms": 1000 * statistics.median(tail)}


def disk_bytes(database_url: str) -> int:
    if database_url.startswith("sqlite"):
        path = Path(database_url.removeprefix("sqlite:///"))
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    with engine.connect() as conn:
        size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
    engine.dispose()
    return int(size)


def time_pages(url: str, run_id: str, steps: int) -> list[tuple[str, float, float]]:
    middle = steps // 2
    reads = [
        ("run page (HTML)", f"/runs/{run_id}"),
        ("layers page (HTML)", f"/runs/{run_id}/layers"),
        ("steps, 2,000 points", f"/api/v1/runs/{run_id}/steps?max_points=2000"),
        ("heatmap 1,000 buckets", f"/api/v1/runs/{run_id}/layers/matrix?buckets=1000"),
        ("one layer's series", f"/api/v1/runs/{run_id}/layers/7/series?max_points=2000"),
        ("zoom: 2,000 steps, full res", f"/api/v1/runs/{run_id}/layers/matrix?buckets=2000"
                                        f"&start={middle}&end={middle + 1999}"),
    ]
    out = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for label, path in reads:
            t0 = time.perf_counter()
            http.get(path).raise_for_status()
            cold = time.perf_counter() - t0
            warm = []
            for _ in range(5):
                t0 = time.perf_counter()
                http.get(path).raise_for_status()
                warm.append(time.perf_counter() - t0)
            out.append((label, cold, statistics.median(warm)))
    return out


def run(backend: str, database_url: str, args: argparse.Namespace) -> None:
    print(f"\n## {backend}: {args.steps:,} steps x {args.layers:,} layers, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    proc, url = start_server(database_url, detect=True)
    try:
        result = ingest(url, "long-run", args.steps, args.layers)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    grads = result["steps"] * args.layers
    values = grads + result["steps"] // SAMPLE_EVERY * args.layers  # + activation abs-max
    size = disk_bytes(database_url)
    print(f"ingest: {result['values_per_s']:,.0f} layer values/s "
          f"({result['steps'] / result['seconds']:,.0f} steps/s), request p50 "
          f"{result['first_ms']:.0f} ms over the first 20 batches, "
          f"{result['last_ms']:.0f} ms over the last 20")
    print(f"disk: {size / 2**20:,.1f} MiB for {values:,} layer values (grad norms and "
          f"activation abs-max): {size / values:.2f} bytes per layer value, "
          f"{size / grads:.2f} per grad norm (everything included: per-step scalars, "
          f"dtypes, summaries, findings, indexes)")
    proc, url = start_server(database_url, detect=True)  # a cold process for the reads
    try:
        print(f"{'read (cold server process)':32} {'first ms':>9} {'warm ms':>9}")
        for label, cold, warm in time_pages(url, "long-run", result["steps"]):
            print(f"{label:32} {1000 * cold:9.0f} {1000 * warm:9.0f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--postgres", help="run on this Postgres server (a fresh database)")
    args = parser.parse_args()
    if args.postgres:
        database_url = _fresh_postgres(args.postgres)
        try:
            run("postgres", database_url, args)
        finally:
            _drop_postgres(database_url)
        return
    with tempfile.TemporaryDirectory(prefix="ampwatch-long-") as tmp:
        run("sqlite", f"sqlite:///{Path(tmp) / 'long.db'}", args)


if __name__ == "__main__":
    main()
