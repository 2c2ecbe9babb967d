"""Sender processes of bench/scale_sim.py: each replays pre-encoded gzip batches of its
share of a phase's ranks on a fixed schedule, as the agents of those ranks would.

A phase has N rank streams (K runs x R ranks, in the order run-major). Every stream first
sends its seq 0 (the prefill, as fast as the servers take it, so every rank of the run has
sent before the clock starts); then the offered load is `rate` batches/s in total, slot i
(at start + i / rate) being stream i mod N's next seq. A stream sends its batches in order,
one at a time, and retries what did not commit (after Retry-After on a 503), as the agent
does. Bodies are built and compressed before the clock starts: the agent does that on its
own thread, so the senders' CPU goes to sending only.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time
from dataclasses import dataclass, field

import httpx

FAULT_EVERY = 3  # a faulted stream's seq s carries a non-finite step when s % 3 == 1
FAULT_RANK_EVERY = 8  # ranks 3, 11, 19, ... of every run are the faulted streams
FAULT_LAYER = 7
GRACE_S = 60.0  # after the window, in-flight batches may still commit (not counted as rate)
HEADERS = {"content-encoding": "gzip", "content-type": "application/json"}
TEMPLATES = 8


@dataclass
class Plan:
    """What one sender process does in one phase."""

    urls: list[str]
    run_ids: list[str]
    ranks_per_run: int
    streams: list[int]  # global stream indices g (run = g // R, rank = g % R) it owns
    rate: float  # batches/s offered by all senders together
    seconds: float
    layers: int
    steps_per_batch: int
    sharded: bool  # every rank carries per-layer grad norms (FSDP); else rank 0 only (DDP)
    prefill_concurrency: int = 8
    connections: int = 48  # per server


@dataclass
class Outcome:
    """What one sender saw: committed batches (in the window and after it), request
    latencies of window batches (first attempt to commit, retries included), how late
    sends started against their schedule, 503s and other failures."""

    prefilled: int = 0
    offered: int = 0
    committed_in_window: int = 0
    committed_after: int = 0
    latencies: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    commit_times: list[float] = field(default_factory=list)  # seconds since window start
    shed: int = 0
    failures: list[str] = field(default_factory=list)
    next_seq: dict[int, int] = field(default_factory=dict)  # stream -> seqs committed


def faulted(rank: int) -> bool:
    return rank % FAULT_RANK_EVERY == 3


def faulty_seq(seq: int) -> bool:
    return seq % FAULT_EVERY == 1


def _template(rng: random.Random, plan: Plan, per_layer: bool, fault: bool) -> bytes:
    """A batch as JSON with %(rank)d, %(seq)d and %(sN)d placeholders; `fault`: its last
    step applied non-finite gradients of layer FAULT_LAYER (not skipped, so no scaler
    calibration excuses it)."""
    steps = []
    for offset in range(plan.steps_per_batch):
        bad = fault and offset == plan.steps_per_batch - 1
        record = {"step": f"@S{offset}@", "loss_scale": 65536.0, "scale_after": 65536.0,
                  "skipped": False, "grad_norm": "Infinity" if bad else 1.0 + rng.random(),
                  "loss": 2.0 + rng.random(), "lr": 3e-4, "t_forward_ms": 30.0,
                  "t_backward_ms": 55.0, "t_optimizer_ms": 5.0,
                  "t_step_ms": 100.0 + rng.random(), "autocast_dtype": "float16"}
        if per_layer:
            norms: list = [round(rng.random(), 6) for _ in range(plan.layers)]
            if bad:
                norms[FAULT_LAYER] = "Infinity"
            record["layer_grad_norm"] = norms
        steps.append(record)
    text = json.dumps({"rank": "@RANK@", "seq": "@SEQ@", "steps": steps}).replace("%", "%%")
    text = text.replace('"@RANK@"', "%(rank)d").replace('"@SEQ@"', "%(seq)d")
    for offset in range(plan.steps_per_batch):
        text = text.replace(f'"@S{offset}@"', f"%(s{offset})d")
    return text.encode()


class Bodies:
    """Pre-encoded batches: a few templates filled per (rank, seq) and gzip-compressed."""

    def __init__(self, plan: Plan) -> None:
        rng = random.Random(0)
        self.plan = plan
        self.templates = {(per_layer, fault): [_template(rng, plan, per_layer, fault)
                                               for _ in range(TEMPLATES if not fault else 1)]
                          for per_layer in (False, True) for fault in (False, True)}

    def body(self, rank: int, seq: int) -> bytes:
        spb = self.plan.steps_per_batch
        per_layer = self.plan.sharded or rank == 0
        fault = faulted(rank) and faulty_seq(seq)
        options = self.templates[(per_layer, fault)]
        values = {b"rank": rank, b"seq": seq,
                  **{b"s%d" % i: seq * spb + i for i in range(spb)}}
        return gzip.compress(options[(rank + seq) % len(options)] % values, 1)


def window_slots(plan: Plan, stream: int) -> list[tuple[int, float]]:
    """(seq, offset in seconds from the window start) of `stream`'s window batches."""
    n_streams = len(plan.run_ids) * plan.ranks_per_run
    slots, seq = [], 1
    while (offset := ((seq - 1) * n_streams + stream) / plan.rate) < plan.seconds:
        slots.append((seq, offset))
        seq += 1
    return slots


async def _post(client: httpx.AsyncClient, run_id: str, body: bytes, give_up: float,
                out: Outcome) -> bool:
    """POST until it commits (True) or `give_up` (monotonic) passes; 503s wait Retry-After."""
    while time.monotonic() < give_up:
        try:
            reply = await client.post(f"/api/v1/runs/{run_id}/batches", content=body,
                                      headers=HEADERS)
        except httpx.TransportError as exc:
            out.failures.append(type(exc).__name__)
            await asyncio.sleep(0.5)
            continue
        if reply.status_code == 200:
            return True
        if reply.status_code == 503:
            out.shed += 1
            await asyncio.sleep(float(reply.headers.get("retry-after") or 1.0))
            continue
        out.failures.append(f"{reply.status_code} {reply.text[:200]}")
        await asyncio.sleep(0.5)
    return False


def _clients(plan: Plan) -> list[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=plan.connections,
                          max_keepalive_connections=plan.connections)
    return [httpx.AsyncClient(base_url=url, timeout=120, limits=limits) for url in plan.urls]


async def prefill(plan: Plan, bodies: Bodies, out: Outcome) -> None:
    """Every owned stream's seq 0, `prefill_concurrency` at a time."""
    clients = _clients(plan)
    gate = asyncio.Semaphore(plan.prefill_concurrency)
    give_up = time.monotonic() + 600

    async def one(stream: int) -> None:
        run_id, rank = plan.run_ids[stream // plan.ranks_per_run], stream % plan.ranks_per_run
        async with gate:
            if await _post(clients[stream % len(clients)], run_id, bodies.body(rank, 0),
                           give_up, out):
                out.prefilled += 1
                out.next_seq[stream] = 1

    try:
        await asyncio.gather(*(one(g) for g in plan.streams))
    finally:
        for client in clients:
            await client.aclose()


def encode_window(plan: Plan, bodies: Bodies) -> dict[int, list[tuple[int, float, bytes]]]:
    """Per owned stream, its window batches: (seq, offset from the start, gzip body)."""
    return {g: [(seq, offset, bodies.body(g % plan.ranks_per_run, seq))
                for seq, offset in window_slots(plan, g)] for g in plan.streams}


async def replay(plan: Plan, encoded: dict[int, list[tuple[int, float, bytes]]],
                 start_wall: float, out: Outcome) -> None:
    """The window: each owned stream sends its scheduled batches in order."""
    clients = _clients(plan)
    # wall clock to this process's monotonic clock (the parent picks the start)
    start = time.monotonic() + (start_wall - time.time())
    end, give_up = start + plan.seconds, start + plan.seconds + GRACE_S

    async def stream_loop(stream: int) -> None:
        run_id = plan.run_ids[stream // plan.ranks_per_run]
        client = clients[stream % len(clients)]
        for seq, offset, body in encoded[stream]:
            due = start + offset
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            sent = time.monotonic()
            if sent >= end:
                return  # past the window: not offered
            out.offered += 1
            out.late.append(sent - due)
            if not await _post(client, run_id, body, give_up, out):
                return
            done = time.monotonic()
            out.latencies.append(done - sent)
            out.next_seq[stream] = seq + 1
            if done <= end:
                out.committed_in_window += 1
                out.commit_times.append(done - start)
            else:
                out.committed_after += 1

    try:
        await asyncio.gather(*(stream_loop(g) for g in plan.streams))
    finally:
        for client in clients:
            await client.aclose()


def sender_main(plan: Plan, index: int, ready, go, start_at, results) -> None:
    """Process target: prefill, report ready, wait for the start, replay, put the Outcome."""
    out = Outcome()
    bodies = Bodies(plan)
    try:
        encoded = encode_window(plan, bodies)
        asyncio.run(prefill(plan, bodies, out))
        ready.put(index)
        go.wait()
        asyncio.run(replay(plan, encoded, start_at.value, out))
    except BaseException as exc:  # the parent must hear of it, not wait forever
        out.failures.append(f"sender {index}: {exc!r}")
        ready.put(index)
    results.put((index, out))
