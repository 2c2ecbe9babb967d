"""A long, wide run through the real ingest path: ingest rate, bytes on disk per layer
value, and page latency from a cold server process.

Builds one run of --steps steps x --layers layers (per-layer grad norms every step,
activation samples every 10 steps, as the agent sends them) from one sender over HTTP
into a real server (uvicorn, detectors on), with realistic grad norms (a log-normal level
per layer, drifting noise per step: what the storage codec sees in real runs). Then it
restarts the server and times the run's pages and API reads, cold (first request) and
warm (median of 5). The detectors' time per batch is read from the server's /metrics
(`ampwatch_analysis_duration_seconds`) over the first 1,000 steps and the last 20 batches:
it should not grow with the run.

    python bench/long_run.py --steps 100000 --layers 1000          # SQLite, a temp file
    python bench/long_run.py --steps 100000 --layers 1000 \\
        --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
    python bench/long_run.py --steps 1000000 --sqlite /data/long.db   # keep the database
    python bench/long_run.py --sqlite /data/long.db --reads-only      # time its reads again
    python bench/long_run.py --steps 200000 --layers 50 --against 2000  # fast at any length

With --against N it also stores a run of N steps (same layers) and prints, for each page
and read, its warm median on both runs and their ratio (target: within 1.5x): the run
page on the step axis and on wall time, compare on wall time, the steps API, a layer's
series and the heatmap.
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
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import _drop_postgres, _fresh_postgres, start_server  # noqa: E402

STEPS_PER_BATCH = 200
SAMPLE_EVERY = 10
TEMPLATES = 16
EARLY_BATCHES = 5  # the detectors' time "early": over the run's first 1,000 steps
LATE_BATCHES = 20  # and "late": over its last 20 batches
RUN_ID = "long-run"
SHORT_ID = "short-run"


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


def analysis_seconds(http: httpx.Client) -> tuple[float, float]:
    """The server's total detector seconds and analysed batches so far."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "ampwatch_analysis_duration_seconds":
            values = {sample.name: sample.value for sample in family.samples}
            return (values["ampwatch_analysis_duration_seconds_sum"],
                    values["ampwatch_analysis_duration_seconds_count"])
    raise SystemExit("the server reports no ampwatch_analysis_duration_seconds")


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
    latencies, sending, marks = [], 0.0, {}
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=300) as http:
        for seq in range(batches):
            if seq in (0, EARLY_BATCHES, batches - LATE_BATCHES):
                marks[seq] = analysis_seconds(http)
            payload = ready.get()
            t0 = time.perf_counter()
            http.post(f"/api/v1/runs/{run_id}/batches", content=payload,
                      headers=headers).raise_for_status()
            latencies.append(time.perf_counter() - t0)
            sending += latencies[-1]
            if seq % max(1, batches // 10) == 0:
                print(f"  ingested {seq * STEPS_PER_BATCH:,} of {steps:,} steps, load "
                      f"average {os.getloadavg()[0]:.1f}", flush=True)
        marks[batches] = analysis_seconds(http)
    head, tail = latencies[:20], latencies[-20:]
    return {"steps": batches * STEPS_PER_BATCH, "seconds": sending,
            "values_per_s": batches * STEPS_PER_BATCH * layers / sending,
            "first_ms": 1000 * statistics.median(head), "last_ms": 1000 * statistics.median(tail),
            "analysis_early_ms": _mean_ms(marks, 0, EARLY_BATCHES),
            "analysis_late_ms": _mean_ms(marks, batches - LATE_BATCHES, batches)}


def _mean_ms(marks: dict, start: int, end: int) -> float | None:
    """Mean detector milliseconds per batch between the marks taken before batches
    `start` and `end`."""
    if start not in marks or end not in marks:
        return None
    seconds, count = marks[end][0] - marks[start][0], marks[end][1] - marks[start][1]
    return 1000 * seconds / count if count else None


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


def disk_breakdown(database_url: str) -> list[tuple[str, int]]:
    """Bytes on disk by table and index, largest first (SQLite's dbstat; on Postgres a
    table's heap, its TOAST (chunk rows and their index) and its indexes apart)."""
    from sqlalchemy import create_engine, text

    if database_url.startswith("sqlite"):
        query = "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"
    else:
        query = """SELECT relname || part, bytes FROM pg_class c, LATERAL (VALUES
                   (' heap', pg_relation_size(c.oid)),
                   (' TOAST', COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0)),
                   (' indexes', pg_indexes_size(c.oid))) AS v(part, bytes)
                   WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace"""
    engine = create_engine(database_url)
    with engine.connect() as conn:
        rows = [(name, int(size)) for name, size in conn.execute(text(query)) if size]
    engine.dispose()
    return sorted(rows, key=lambda row: -row[1])


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


def length_reads(run_id: str) -> list[tuple[str, str]]:
    """The reads that should cost the same at any length of run."""
    return [
        ("run page, step axis", f"/runs/{run_id}"),
        ("run page, wall time", f"/runs/{run_id}?x=wall"),
        ("compare, wall time", f"/compare?run={run_id}&x=wall"),
        ("steps API, 2,000 points", f"/api/v1/runs/{run_id}/steps?max_points=2000"),
        ("one layer's series", f"/api/v1/runs/{run_id}/layers/7/series?max_points=2000"),
        ("heatmap, 200 buckets", f"/api/v1/runs/{run_id}/layers/matrix?buckets=200"),
    ]


def time_ratios(url: str, repeats: int = 7) -> list[tuple[str, float, float]]:
    """(read, short run's warm median s, long run's) after a warm-up of each, the two
    runs' requests interleaved so that the machine's load falls on both alike."""
    out = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for (label, short), (_, long) in zip(length_reads(SHORT_ID), length_reads(RUN_ID),
                                             strict=True):
            times: dict[str, list[float]] = {short: [], long: []}
            for i in range(repeats + 1):
                for path in (short, long):
                    t0 = time.perf_counter()
                    http.get(path).raise_for_status()
                    if i:
                        times[path].append(time.perf_counter() - t0)
            out.append((label, statistics.median(times[short]), statistics.median(times[long])))
    return out


def print_ratios(url: str, short_steps: int, long_steps: int) -> None:
    print(f"\n{'read (warm median of 7)':26} {short_steps:>9,} {long_steps:>9,}  ratio   "
          f"(ms; load average {os.getloadavg()[0]:.1f})")
    for label, short, long in time_ratios(url):
        print(f"{label:26} {1000 * short:9.1f} {1000 * long:9.1f}  {long / short:5.2f}",
              flush=True)


def run(backend: str, database_url: str, args: argparse.Namespace) -> None:
    print(f"\n## {backend}: {args.steps:,} steps x {args.layers:,} layers, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if not args.reads_only:
        build(database_url, args)
    proc, url = start_server(database_url, detect=True)  # a cold process for the reads
    try:
        stored = httpx.get(f"{url}/api/v1/runs/{RUN_ID}", timeout=60).raise_for_status().json()
        print(f"{'read (cold server process)':32} {'first ms':>9} {'warm ms':>9}   "
              f"(load average {os.getloadavg()[0]:.1f})")
        for label, cold, warm in time_pages(url, RUN_ID, stored["last_step"] + 1):
            print(f"{label:32} {1000 * cold:9.0f} {1000 * warm:9.0f}", flush=True)
        if args.against:
            print_ratios(url, args.against, stored["last_step"] + 1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"load average after the reads {os.getloadavg()[0]:.1f}")


def build(database_url: str, args: argparse.Namespace) -> None:
    proc, url = start_server(database_url, detect=True)
    try:
        if args.against:
            ingest(url, SHORT_ID, args.against, args.layers)
        result = ingest(url, RUN_ID, args.steps, args.layers)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    grads = result["steps"] * args.layers
    values = grads + result["steps"] // SAMPLE_EVERY * args.layers  # + activation abs-max
    size = disk_bytes(database_url)
    print(f"ingest: {result['values_per_s']:,.0f} layer values/s "
          f"({result['steps'] / result['seconds']:,.0f} steps/s), request p50 "
          f"{result['first_ms']:.0f} ms over the first 20 batches, "
          f"{result['last_ms']:.0f} ms over the last 20; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"detectors per batch: {_ms(result['analysis_early_ms'])} over the first "
          f"{EARLY_BATCHES * STEPS_PER_BATCH:,} steps, {_ms(result['analysis_late_ms'])} over "
          f"the last {LATE_BATCHES} batches (to step {result['steps']:,})")
    print(f"disk: {size / 2**20:,.1f} MiB for {values:,} layer values (grad norms and "
          f"activation abs-max): {size / values:.2f} bytes per layer value, "
          f"{size / grads:.2f} per grad norm (everything included: per-step scalars, "
          f"dtypes, summaries, findings, indexes)", flush=True)
    for name, part in disk_breakdown(database_url)[:8]:
        print(f"  {name:40} {part / 2**20:10,.1f} MiB  {part / values:.3f} bytes per value")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--postgres", help="run on this Postgres server (a fresh database)")
    parser.add_argument("--sqlite", type=Path,
                        help="build into (or with --reads-only, read) this SQLite file and "
                        "keep it; by default a temporary file")
    parser.add_argument("--against", type=int, metavar="STEPS",
                        help="also store a run of STEPS steps and print each read's ratio")
    parser.add_argument("--reads-only", action="store_true",
                        help="time the reads of the run already in --sqlite")
    args = parser.parse_args()
    if args.reads_only and args.sqlite is None:
        parser.error("--reads-only needs --sqlite")
    if args.postgres:
        database_url = _fresh_postgres(args.postgres)
        try:
            run("postgres", database_url, args)
        finally:
            _drop_postgres(database_url)
        return
    if args.sqlite is not None:
        if not args.reads_only and args.sqlite.exists():
            parser.error(f"{args.sqlite} exists: the build needs a new file")
        run("sqlite", f"sqlite:///{args.sqlite.resolve()}", args)
        return
    with tempfile.TemporaryDirectory(prefix="ampwatch-long-") as tmp:
        run("sqlite", f"sqlite:///{Path(tmp) / 'long.db'}", args)


if __name__ == "__main__":
    main()
