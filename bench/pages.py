"""Dashboard page latency on a 100,000-step x 200-layer run.

Starts a real server (SQLite file, detectors on), fills one run with agent-shaped gzip
batches through the ingest API (bench/ingest.py's batches: 100 steps each, per-layer
grad norms every step, activation samples every 10 steps, 0.2% skipped steps), then
times each page as HTML, as its JSON twin and as the live update a polling page
fetches: median and best of 7 GETs over loopback after one warm-up, and the body size.

    python bench/pages.py                    # ~3 minutes, most of it ingest
    python bench/pages.py --steps 20000      # a quicker look
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx
from ingest import LAYERS, ingest, start_server, time_get

TARGET_MS = 500
RUN = "long-run"
PAGES = (
    ("runs list", "/"),
    ("run overview", f"/runs/{RUN}"),
    ("run layers", f"/runs/{RUN}/layers"),
    ("compare", f"/compare?run={RUN}"),
    # a time axis sums every stored step's t_step_ms from the run's start
    ("overview, time", f"/runs/{RUN}?x=relative"),
    ("compare, time", f"/compare?run={RUN}&x=wall"),
)
FORMATS = (("html", ""), ("json twin", "format=json"), ("live update", "format=update"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ampwatch-bench-pages-") as tmp:
        proc, url = start_server(f"sqlite:///{Path(tmp) / 'bench.db'}", detect=True)
        try:
            filled = ingest(url, RUN, 1, args.steps)
            print(f"run: {filled['steps']:,} steps x {LAYERS} layers "
                  f"(ingested at {filled['steps_per_s']:.0f} steps/s)\n")
            print(f"| {'page':<14} | {'form':<11} | {'median ms':>9} | {'best ms':>7} | "
                  f"{'KiB':>6} |")
            print(f"|{'-' * 16}|{'-' * 13}|{'-' * 11}|{'-' * 9}|{'-' * 8}|")
            worst = 0.0
            for page, path in PAGES:
                for form, query in FORMATS:
                    if page == "runs list" and form == "live update":
                        continue
                    target = f"{path}{'&' if '?' in path else '?'}{query}" if query else path
                    median, best = time_get(url, target)
                    size = len(httpx.get(url + target, timeout=120).content) / 1024
                    worst = max(worst, median)
                    print(f"| {page:<14} | {form:<11} | {1000 * median:>9.0f} | "
                          f"{1000 * best:>7.0f} | {size:>6.0f} |", flush=True)
            verdict = "within" if worst * 1000 < TARGET_MS else "OVER"
            print(f"\nslowest median {1000 * worst:.0f} ms: {verdict} the {TARGET_MS} ms target")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
