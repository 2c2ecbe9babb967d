"""`agent_overhead.py --mode processes`: the agent's cost with nothing shared but the
machine. Same-process A/B (`--mode ab`) puts the agent's worker thread on the plain
copy's GIL too, so part of its cost is charged to the baseline; here every measured
process trains one copy of the model on one torch thread, and the configurations take
turns in shuffled, interleaved rounds (`--processes` processes each):

  baseline        no agent
  agent_offline   the agent writing only its spool (AMPWATCH_MODE=offline): its own cost
  agent_server    the agent sending to a server on this machine: its cost plus what the
                  server's ingest and detectors take from the same cores

The server's CPU time during the agent_server processes (user + system, from /proc) is
reported per training step: what a server on the training machine costs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CONFIGS = ("baseline", "agent_offline", "agent_server")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its waited-for children so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the ")": state is field 3, so utime..cstime (fields 14-17) sit at 11..14
    ticks = sum(int(v) for v in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def run_one(script: Path, config: str, args: argparse.Namespace, server: str,
            spool: str) -> list[float]:
    """One worker process of `config`; its step times (ms)."""
    env = {**os.environ, "AMPWATCH_SPOOL_DIR": spool}
    if config == "agent_offline":
        env["AMPWATCH_MODE"] = "offline"
    out = subprocess.run(
        [sys.executable, str(script), "--worker", config, "--steps", str(args.steps),
         "--warmup", str(args.warmup), "--server", server],
        capture_output=True, text=True, check=True, cwd=script.parents[1], env=env)
    line = next(line for line in reversed(out.stdout.splitlines())
                if line.startswith('{"config"'))
    return json.loads(line)["times"]


def mode_processes(args: argparse.Namespace, server: str, server_pid: int | None,
                   script: Path) -> dict[str, Any]:
    """Run the rounds and print the table; returns the figures (for docs/benchmarks.md)."""
    rng = random.Random(args.seed)
    times: dict[str, list[list[float]]] = {c: [] for c in CONFIGS}
    server_cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="ampwatch-bench-spool-") as spool_root:
        for round_index in range(args.processes):
            order = list(CONFIGS)
            rng.shuffle(order)
            for config in order:
                spool = f"{spool_root}/{config}-{round_index}"
                before = cpu_seconds(server_pid) if server_pid else 0.0
                times[config].append(run_one(script, config, args, server, spool))
                if config == "agent_server" and server_pid:
                    server_cpu += cpu_seconds(server_pid) - before
            print(f"round {round_index + 1}/{args.processes} done", file=sys.stderr)
    base = statistics.median(t for run in times["baseline"] for t in run)
    rows = []
    for config in CONFIGS:
        pooled = [t for run in times[config] for t in run]
        per_process = [statistics.median(run) / base for run in times[config]]
        rows.append({"config": config, "processes": len(times[config]),
                     "steps": len(pooled), "median_ms": statistics.median(pooled),
                     "ratio": statistics.median(pooled) / base,
                     "process_ratios": per_process})
    steps_sent = args.processes * (args.steps + args.warmup)
    server_ms = 1000.0 * server_cpu / steps_sent if server_pid else None
    print(f"\nper-process mode: {args.processes} processes per configuration, interleaved "
          f"in shuffled rounds, {args.steps} steps each (warm-up {args.warmup}), one torch "
          "thread per process")
    print(f"{'configuration':16} {'processes':>9} {'steps':>6} {'median ms':>10} "
          f"{'ratio':>7}  per-process ratios")
    for r in rows:
        spread = " ".join(f"{x:.3f}" for x in r["process_ratios"])
        print(f"{r['config']:16} {r['processes']:9d} {r['steps']:6d} {r['median_ms']:10.2f} "
              f"{r['ratio']:7.3f}  {spread}")
    if server_ms is not None:
        print(f"server CPU while the agent sent to it: {server_cpu:.2f} s for {steps_sent} "
              f"steps, {server_ms:.2f} ms per training step")
    return {"rows": rows, "server_cpu_ms_per_step": server_ms}
