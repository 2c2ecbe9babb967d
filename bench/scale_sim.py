"""Scale-out simulation (issue 31): a fixed offered load of 1,000-layer batches into two
`ampwatch serve` processes on one Postgres (and one `ampwatch worker` when this ampwatch
has the command), shaped three ways, and SQLite's one-sender ingest rate.

Shapes, each a phase with its own runs: (a) one run of R ranks, R = 64, 256, 1,024 (and
4,096 with --full); (b) K runs of 64 ranks, K = 1, 4, 16 (and 64); (c) with a worker
only: one run of 64 ranks for three windows, the worker at full speed, then slowed
tenfold (SIGSTOP/SIGCONT, running 10% of each 100 ms), then killed (SIGKILL) and
restarted halfway through the third.
Every rank of a phase sends its first batch before the clock starts (the prefill); then
sender processes (bench/scale_senders.py) replay pre-encoded gzip batches at `--rate`
batches/s in total, each rank in order and one batch at a time, retrying what did not
commit. Ranks 3, 11, 19, ... of every run carry a non-finite step in every third batch:
after the queue has drained, each must hold one `nonfinite` finding counting exactly
those steps (nothing lost), and no finding may be stored twice (nothing duplicated).

Per phase it prints committed vs offered batches/s; CPU-ms per committed batch of the two
servers, the database's backends and the worker (from /proc); sessions waiting on a lock
(pg_stat_activity, every 0.25 s); ingest p50/p99 (first attempt to commit) and 503s;
queue depth and worker lag; the run page and ranks API p99 while ingesting. Pages and
/metrics are read from a third `ampwatch serve` on the same database that only serves them
(so the ingest CPU is ingest's: a scrape reads every live run, and the probe scrapes each
second; the reader's Postgres sessions are left out of the database's CPU too;
`--pages-on-ingest` reads both from the last ingest server instead); batches stored in
the database against those acknowledged. The database is one of its own on the Postgres
server named by `--postgres`, dropped at the end.

    python bench/scale_sim.py                  # 4 to 10 minutes on 2 shared cores
    python bench/scale_sim.py --full           # the issue's shapes: add R=4,096 and K=64
    python bench/scale_sim.py --rate 40 --seconds 60 --shapes a,c
    python bench/scale_sim.py --quick --json out.json   # a minute: what tests/bench runs
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from datetime import UTC, datetime

import psycopg
from ingest import ingest as sqlite_ingest  # bench/ingest.py: the one-sender SQLite figure
from ingest import start_server as start_sqlite_server
from scale_cluster import Cluster, cpu_delta
from scale_probes import PageProbe, PostgresProbe, QueueProbe, percentile
from scale_senders import GRACE_S, Outcome, Plan, faulted, faulty_seq, sender_main

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def run_phase(cluster: Cluster, shape: str, runs: int, ranks: int, seconds: float,
              during=None) -> dict:
    """One phase: register `runs` runs of `ranks` ranks, prefill, replay for `seconds`
    while sampling, drain the queue, check the database. `during(start)` (shape c) acts
    on the worker while the window runs, `start` being its monotonic start."""
    args = cluster.args
    tag = uuid.uuid4().hex[:6]
    run_ids = [f"scale-{shape}-{runs}x{ranks}-{i}-{tag}" for i in range(runs)]
    cluster.register(run_ids, ranks)
    streams = list(range(runs * ranks))
    plans = [Plan(urls=cluster.urls, run_ids=run_ids, ranks_per_run=ranks,
                  streams=streams[k::args.senders], rate=args.rate, seconds=seconds,
                  layers=args.layers, steps_per_batch=args.steps_per_batch,
                  sharded=args.layout == "sharded") for k in range(args.senders)]
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    senders = [ctx.Process(target=sender_main, args=(plan, k, ready, go, start_at, results))
               for k, plan in enumerate(plans)]
    try:
        t_prefill = time.monotonic()
        for proc in senders:
            proc.start()
        for _ in senders:
            ready.get(timeout=1800)
        prefill_s = time.monotonic() - t_prefill
        cluster.drain(args.drain_timeout)  # the prefill's analysis is not the window's work

        pg = PostgresProbe(cluster.dsn, cluster.database)
        queue = QueueProbe(cluster.reader_url)  # a scrape reads every live run: not ingest's
        pages = PageProbe(cluster.reader_url, run_ids[0])
        load_before = os.getloadavg()[0]
        start_at.value = time.time() + 1.0
        start = time.monotonic() + 1.0
        go.set()
        time.sleep(max(0.0, start - time.monotonic()))
        cpu_before = cluster.cpu(pg)
        for probe in (pg, queue, pages):
            probe.start()
        if during is not None:
            during(start)
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        cpu = cpu_delta(cpu_before, cluster.cpu(pg))
        for probe in (pg, pages):
            probe.stop()
        outcomes = [results.get(timeout=seconds + GRACE_S + 120)[1] for _ in senders]
        for proc in senders:
            proc.join()
        drain_s = cluster.drain(args.drain_timeout)
        queue.stop()
    finally:  # an interrupt (Ctrl-C) must not leave senders for the exit to wait on
        for proc in senders:
            if proc.is_alive():
                proc.terminate()
    return figures(cluster, shape, run_ids, ranks, seconds, outcomes, cpu, pg, queue, pages,
                   prefill_s=prefill_s, drain_s=drain_s, start=start,
                   load=(load_before, os.getloadavg()[0]))


def figures(cluster: Cluster, shape: str, run_ids: list[str], ranks: int, seconds: float,
            outcomes: list[Outcome], cpu: dict, pg: PostgresProbe, queue: QueueProbe,
            pages: PageProbe, *, prefill_s: float, drain_s: float | None, start: float,
            load: tuple[float, float]) -> dict:
    """The phase's row: rates, costs, latencies, and the database checks."""
    rate = cluster.args.rate
    committed = sum(o.committed_in_window for o in outcomes)
    acked = sum(o.prefilled + o.committed_in_window + o.committed_after for o in outcomes)
    latencies = [t for o in outcomes for t in o.latencies]
    next_seq = {g: n for o in outcomes for g, n in o.next_seq.items()}
    per_batch = 1000 / max(committed, 1)
    row = {
        "shape": shape, "runs": len(run_ids), "ranks": ranks, "seconds": seconds,
        "offered_per_s": math.ceil(rate * seconds) / seconds,
        "committed_per_s": committed / seconds,
        "cpu_ms_servers": cpu["servers"] * per_batch,
        "cpu_ms_postgres": cpu["postgres"] * per_batch,
        "cpu_ms_worker": cpu["worker"] * per_batch, **pg.summary(),
        "reader_cpu_s": cpu["reader"],
        "ingest_p50_s": percentile(latencies, 0.5), "ingest_p99_s": percentile(latencies, 0.99),
        "shed_503": sum(o.shed for o in outcomes),
        "late_median_s": statistics.median(late) if (late := [t for o in outcomes
                                                              for t in o.late]) else None,
        "queue_depth_max": queue.max_depth(), "worker_lag_max_s": max(queue.lag, default=None),
        **pages.summary(), "prefill_s": prefill_s, "drain_s": drain_s,
        "acknowledged": acked, "stored": _stored(cluster.dsn, run_ids),
        "failures": [f for o in outcomes for f in o.failures][:5],
        "load_before": load[0], "load_after": load[1],
        "commit_offsets": sorted(t for o in outcomes for t in o.commit_times),
    }
    row.update(check_findings(cluster.dsn, run_ids, ranks, next_seq))
    return row


def _stored(dsn: str, run_ids: list[str]) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM batches WHERE run_id = ANY(%s)",
                            (run_ids,)).fetchone()[0]


def check_findings(dsn: str, run_ids: list[str], ranks: int, next_seq: dict[int, int]) -> dict:
    """Each faulted rank's `nonfinite` findings count exactly its non-finite steps that
    were acknowledged; no (run, rank, key, first step) is stored twice."""
    expected = {}
    for g, n in next_seq.items():
        if faulted(g % ranks):
            expected[(run_ids[g // ranks], g % ranks)] = sum(map(faulty_seq, range(n)))
    with psycopg.connect(dsn) as conn:
        found = dict(((run, rank), total) for run, rank, total in conn.execute(
            "SELECT run_id, rank, sum(count) FROM findings WHERE kind = 'nonfinite' "
            "AND run_id = ANY(%s) GROUP BY run_id, rank", (run_ids,)))
        duplicates = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM findings WHERE run_id = ANY(%s) "
            "GROUP BY run_id, rank, key, step HAVING count(*) > 1) d", (run_ids,)).fetchone()[0]
    lost = sum(1 for key, n in expected.items() if found.get(key, 0) < n)
    extra = sum(1 for key, n in found.items() if n > expected.get(key, 0))
    return {"faulted_ranks": sum(1 for n in expected.values() if n),
            "nonfinite_steps_sent": sum(expected.values()),
            "nonfinite_steps_found": sum(found.values()), "findings_lost": lost,
            "findings_extra": extra, "findings_duplicated": duplicates}


def shape_c(cluster: Cluster) -> dict:
    """One run of 64 ranks for three windows of `--seconds`: the worker at full speed,
    slowed tenfold, then killed at once and restarted halfway through the third."""
    worker, third = cluster.worker, cluster.args.seconds
    assert worker is not None

    def until(t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))

    def script(start: float) -> None:
        until(start + third)
        with worker.slowed():
            until(start + 2 * third)
        worker.kill()
        until(start + 2.5 * third)
        worker.start()

    def during(start: float) -> None:
        threading.Thread(target=script, args=(start,), daemon=True).start()

    row = run_phase(cluster, "c", 1, 64, 3 * third, during)
    segments = [sum(1 for t in row["commit_offsets"] if i * third <= t < (i + 1) * third) / third
                for i in range(3)]
    row["segments_per_s"] = segments
    row["ingest_change"] = min(segments[1:]) / segments[0] - 1 if segments[0] else None
    return row


def sqlite_rate(args: argparse.Namespace, directory: str) -> dict:
    """bench/ingest.py's one-sender SQLite ingest (200-step batches of 200 layers, the
    embedded analysis on), `--sqlite-repeats` times on one server: the median rate."""
    proc, url = start_sqlite_server(f"sqlite:///{directory}/scale-sqlite.db", True)
    try:
        rates = [sqlite_ingest(url, f"sqlite-{i}-{uuid.uuid4().hex[:6]}", 1,
                               args.sqlite_steps)["layer_values_per_s"]
                 for i in range(args.sqlite_repeats)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"layer_values_per_s": statistics.median(rates), "repeats": rates}


COLUMNS = ("shape", "R", "K", "offered/s", "committed/s", "%", "CPU ms/batch srv+pg+wrk",
           "lock waits mean/max", "ingest p50/p99 s", "503s", "queue max", "lag max s",
           "page p99 s", "stored/acked", "findings lost/extra/dup")


def _s(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def table_row(r: dict) -> list[str]:
    return [r["shape"], str(r["ranks"]), str(r["runs"]), f"{r['offered_per_s']:.1f}",
            f"{r['committed_per_s']:.1f}", f"{100 * r['committed_per_s'] / r['offered_per_s']:.0f}",
            f"{r['cpu_ms_servers']:.1f}+{r['cpu_ms_postgres']:.1f}+{r['cpu_ms_worker']:.1f}",
            f"{r['lock_wait_mean']:.2f}/{r['lock_wait_max']}",
            f"{_s(r['ingest_p50_s'])}/{_s(r['ingest_p99_s'])}", str(r["shed_503"]),
            _s(r["queue_depth_max"], ".0f"), _s(r["worker_lag_max_s"], ".1f"),
            _s(r["page_p99_s"]), f"{r['stored']}/{r['acknowledged']}",
            f"{r['findings_lost']}/{r['findings_extra']}/{r['findings_duplicated']}"]


def print_table(rows: list[dict], header: bool = True) -> None:
    """A Markdown table (columns as wide as their header, so rows printed one at a time
    line up under it)."""
    cells = ([list(COLUMNS)] if header else []) + [table_row(r) for r in rows]
    widths = [len(c) for c in COLUMNS]
    for line in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |",
              flush=True)
        if header and line is cells[0]:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", default=os.environ.get("AMPWATCH_BENCH_POSTGRES_URL",
                                                             DEFAULT_POSTGRES),
                        help="a URL on the Postgres server whose user may CREATE DATABASE "
                             "(default %(default)s)")
    parser.add_argument("--rate", type=float, default=20.0, help="offered batches/s")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="measured window of each phase (shape c: three of them)")
    parser.add_argument("--shapes", default="a,b,c")
    parser.add_argument("--ranks", default="64,256,1024", help="R of shape a")
    parser.add_argument("--runs", default="1,4,16", help="K of shape b")
    parser.add_argument("--full", action="store_true",
                        help="the issue's shapes: R up to 4,096, K up to 64, 30 s windows")
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps-per-batch", type=int, default=2)
    parser.add_argument("--layout", choices=("sharded", "replicated"), default="sharded",
                        help="sharded: every batch carries its rank's per-layer grad norms "
                             "(FSDP); replicated: rank 0's only (DDP)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--senders", type=int, default=2, help="sender processes")
    parser.add_argument("--pages-on-ingest", dest="reader", action="store_false",
                        help="read pages from the last ingest server (their CPU then counts "
                             "as ingest's) instead of a third server that only serves them")
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--no-worker", action="store_true",
                        help="start no `ampwatch worker` (the servers' own threads analyse)")
    parser.add_argument("--embedded-workers", action="store_true",
                        help="keep the servers' worker threads beside the `ampwatch worker`")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the phases of shapes a and b this many times, in turn, and "
                             "judge the spreads across R and K on each phase's median")
    parser.add_argument("--sqlite-steps", type=int, default=20_000)
    parser.add_argument("--sqlite-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds a phase, 16 ranks: checks the bench, not the code")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.full:
        args.ranks, args.runs, args.seconds = "64,256,1024,4096", "1,4,16,64", 30.0
    if args.quick:
        args.rate, args.seconds, args.ranks, args.runs = 16.0, 3.0, "16", "2"
        args.sqlite_steps, args.sqlite_repeats, args.drain_timeout = 400, 1, 60.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shapes = set(args.shapes.split(","))
    started = datetime.now(UTC)
    load = os.getloadavg()
    cluster = Cluster(args)
    rows: list[dict] = []
    note = ""
    try:
        cluster.start()
        print(f"scale_sim {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load "
              f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.servers} servers"
              f"{' + a page reader' if args.reader else ''}, "
              f"{'one worker' if cluster.worker else 'no worker (analysis inside ingest)'}; "
              f"{args.rate:g} batches/s offered, {args.steps_per_batch} steps x "
              f"{args.layers} layers ({args.layout}), {args.seconds:g} s windows", flush=True)
        phases = ([("a", 1, int(r)) for r in args.ranks.split(",")] if "a" in shapes else []) \
            + ([("b", int(k), 64) for k in args.runs.split(",")] if "b" in shapes else [])
        print_table([])
        for shape, runs, ranks in phases * args.repeats:  # round-robin: drift hits each alike
            rows.append(run_phase(cluster, shape, runs, ranks, args.seconds))
            print_table(rows[-1:], header=False)
        if "c" in shapes and cluster.worker is not None:
            rows.append(shape_c(cluster))
            print_table(rows[-1:], header=False)
        elif "c" in shapes:
            note = "shape c skipped: this ampwatch has no `ampwatch worker`"
    finally:
        cluster.close()
    sqlite = None
    if args.sqlite_repeats:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ampwatch-scale-") as directory:
            sqlite = sqlite_rate(args, directory)
    report(args, rows, sqlite, note, started, load, cluster.database)


def _reader_cpu(r: dict) -> str:
    if not r["reader_cpu_s"]:
        return "pages read from an ingest server"
    return f"page reader {1000 * r['reader_cpu_s'] / max(r['page_reads'], 1):.0f} CPU-ms a read"


def spreads(rows: list[dict]) -> dict[str, dict]:
    """Servers' and all processes' CPU a batch, the median of each phase's repeats, and
    their max/min across R (shape a) and across K (shape b): the issue's 15% line."""
    out = {}
    for shape, axis in (("a", "ranks"), ("b", "runs")):
        medians = {}
        for r in rows:
            if r["shape"] == shape:
                medians.setdefault(r[axis], []).append(
                    (r["cpu_ms_servers"],
                     r["cpu_ms_servers"] + r["cpu_ms_postgres"] + r["cpu_ms_worker"]))
        if len(medians) < 2:
            continue
        servers = {k: statistics.median(v[0] for v in vs) for k, vs in medians.items()}
        total = {k: statistics.median(v[1] for v in vs) for k, vs in medians.items()}
        out["R" if shape == "a" else "K"] = {
            "repeats": min(len(vs) for vs in medians.values()), "servers": servers,
            "total": total, "servers_spread": max(servers.values()) / min(servers.values()),
            "total_spread": max(total.values()) / min(total.values())}
    return out


def spread_lines(rows: list[dict]) -> list[str]:
    lines = []
    for axis, s in spreads(rows).items():
        each = ", ".join(f"{k}: {v:.1f}" for k, v in s["servers"].items())
        lines.append(f"across {axis} (median of {s['repeats']} a phase): servers' CPU ms a "
                     f"batch {each}; max/min {s['servers_spread']:.3f} (servers), "
                     f"{s['total_spread']:.3f} (servers + Postgres + worker)")
    return lines


def report(args: argparse.Namespace, rows: list[dict], sqlite: dict | None, note: str,
           started: datetime, load: tuple[float, float, float], database: str) -> None:
    print()
    print_table(rows)
    for r in rows:
        segments = ", ".join(f"{s:.1f}" for s in r.get("segments_per_s", ()))
        extra = "" if r.get("ingest_change") is None else (
            f"; segments normal/slowed/killed {segments} batches/s (change "
            f"{100 * r['ingest_change']:+.0f}%)")
        print(f"{r['shape']} R={r['ranks']} K={r['runs']}: prefill {r['prefill_s']:.0f} s, "
              f"drain {_s(r['drain_s'], '.1f')} s, lock-wait samples "
              f"{100 * r['lock_wait_share']:.0f}%, senders late (median) "
              f"{_s(r['late_median_s'])} s, run page p99 {_s(r['run page p99_s'])} s, ranks API "
              f"p99 {_s(r['ranks API p99_s'])} s ({r['page_reads']} reads, "
              f"{r['page_shed_503']} 503s retried; {_reader_cpu(r)}), load "
              f"{r['load_before']:.1f}->"
              f"{r['load_after']:.1f}{extra}")
        for failure in r["failures"] + r["page_errors"]:
            print(f"  {failure}")
    for line in spread_lines(rows):
        print(line)
    if note:
        print(note)
    if sqlite is not None:
        print(f"SQLite, one sender, 200-step batches of 200 layers: "
              f"{sqlite['layer_values_per_s'] / 1e6:.2f}M layer values/s (median of "
              f"{len(sqlite['repeats'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "started": started.isoformat(), "load": load,
                       "database": database,
                       "phases": [{k: v for k, v in r.items() if k != "commit_offsets"}
                                  for r in rows], "spreads": spreads(rows),
                       "sqlite": sqlite, "note": note}, f, indent=1)


if __name__ == "__main__":
    main()
