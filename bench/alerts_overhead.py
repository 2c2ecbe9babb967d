"""What alerting costs ingest: the same batches into the real app (in process, over
FastAPI's TestClient, a SQLite file each) with alert rules and a webhook target, and
without, interleaved A/B so machine load hits both arms alike.

Two workloads: a healthy fp16 run (no finding changes: the outbox listener only looks),
and a run whose scaler diverges from its second batch on (findings open and escalate:
notifications are written in the ingest transaction). The webhook is a local receiver
that answers after 0.5 s, so a dispatcher that blocked ingest would show.

    python bench/alerts_overhead.py             # ~1 minute on a quiet machine
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fastapi.testclient import TestClient

from ampwatch.server.app import close_app, create_app
from ampwatch.server.settings import Settings

LAYERS = 50
STEPS_PER_BATCH = 50
BATCHES = 40
ROUNDS = 6


class SlowHook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(0.5)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def steps(first: int, diverging: bool) -> list[dict]:
    out = []
    for s in range(first, first + STEPS_PER_BATCH):
        bad = diverging and s >= STEPS_PER_BATCH
        out.append({"step": s, "loss_scale": 65536.0, "scale_after": 32768.0 if bad else 65536.0,
                    "skipped": bad, "grad_norm": "Infinity" if bad else 1.0, "loss": 2.0,
                    "lr": 1e-3, "autocast_dtype": "float16",
                    "layer_grad_norm": ["Infinity" if bad and i == 0 else 0.1
                                        for i in range(LAYERS)]})
    return out


def run_arm(workdir: Path, alerts: dict | None, diverging: bool, tag: str) -> list[float]:
    settings = Settings(database_url=f"sqlite:///{workdir / f'{tag}.db'}",
                        **({"alerts": alerts} if alerts else {}))
    app = create_app(settings)
    layers = [{"index": i, "name": f"fc{i}", "type": "Linear", "param_count": 4096,
               "attrs": {"in_features": 64, "out_features": 64}, "forward_index": i}
              for i in range(LAYERS)]
    bodies = [json.dumps({"rank": 0, "seq": b, "steps": steps(b * STEPS_PER_BATCH, diverging)})
              for b in range(BATCHES)]
    times = []
    with TestClient(app) as api:
        api.put("/api/v1/runs/r", json={"name": "r", "layers": layers,
                                        "environment": {"autocast_dtype": "float16"}})
        for body in bodies:
            start = time.perf_counter()
            reply = api.post("/api/v1/runs/r/batches", content=body,
                             headers={"content-type": "application/json"})
            times.append(time.perf_counter() - start)
            assert reply.status_code == 200, reply.text
        queued = api.get("/api/v1/alerts/deliveries").json()["total"]
    close_app(app)
    if alerts and diverging:
        assert queued > 0, "the diverging run queued no notification"
    return times


def main() -> int:
    hook = ThreadingHTTPServer(("127.0.0.1", 0), SlowHook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    alerts = {"targets": {"hook": {"url": f"http://127.0.0.1:{hook.server_address[1]}/h"}},
              "rules": [{"name": "all", "severity": "info", "targets": ["hook"],
                         "on_resolve": True}]}
    print(f"load average before: {os.getloadavg()[0]:.2f}; {BATCHES} batches of "
          f"{STEPS_PER_BATCH} steps x {LAYERS} layers per arm, {ROUNDS} rounds interleaved")
    print("| workload | alerts off p50 ms | alerts on p50 ms | ratio on/off | "
          "off p99 ms | on p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for diverging in (False, True):
            off: list[float] = []
            on: list[float] = []
            for r in range(ROUNDS):  # ABBA: neither arm always runs first
                arms = [(off, None, "off"), (on, alerts, "on")]
                for times, config, tag in arms if r % 2 else arms[::-1]:
                    times += run_arm(Path(tmp), config, diverging, f"{tag}-{diverging}-{r}")
            p50_off, p50_on = statistics.median(off) * 1e3, statistics.median(on) * 1e3
            p99 = [statistics.quantiles(x, n=100)[98] * 1e3 for x in (off, on)]
            print(f"| {'diverging' if diverging else 'healthy'} | {p50_off:.1f} | "
                  f"{p50_on:.1f} | {p50_on / p50_off:.3f} | {p99[0]:.1f} | {p99[1]:.1f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    hook.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
