"""What the step guard (attach(guard=...), docs/guard.md) costs a training step on the CPU.

The GPT of bench/agent_overhead.py (~4M parameters, seq 64, batch 2), bf16 autocast
without a scaler, clip_grad_norm_, AdamW, one torch thread, the agent offline. Each
configuration runs in its own process, in shuffled interleaved rounds so machine noise
cancels; the table gives the median ms per step and its ratio to the agent without the
guard measured in the same rounds (and to no agent at all).

    python bench/guard_overhead.py --rounds 3 --steps 40

Configurations: plain (no agent), agent (no guard), guard_auto (fused AdamW: its
found_inf), guard_select (the device-side copy and torch.where, as on an accelerator with
an unfused optimizer), guard_sync (one host read a step), guard_spikes (auto with
skip_spikes=5), adamw_foreach_plain / adamw_foreach_guard (an unfused AdamW, for which
"auto" means sync on the CPU).
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from bench.agent_overhead import BATCH, GPT, SEQ, VOCAB  # noqa: E402

CONFIGS: dict[str, tuple[dict | None, bool, bool]] = {
    # name: (guard option, or None for the agent without it; attach at all; fused AdamW)
    "plain": (None, False, True),
    "agent": (None, True, True),
    "guard_auto": ({}, True, True),
    "guard_select": ({"mode": "select"}, True, True),
    "guard_sync": ({"mode": "sync"}, True, True),
    "guard_spikes": ({"skip_spikes": 5}, True, True),
    "adamw_foreach_agent": (None, True, False),
    "adamw_foreach_guard": ({}, True, False),
}


def run_worker(config: str, steps: int, warmup: int) -> None:
    from ampwatch import agent

    torch.set_num_threads(1)
    guard, attached, fused = CONFIGS[config]
    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused,
                                  foreach=None if fused else True)
    attachment = None
    if attached:
        attachment = agent.attach(model, offline=True, record=False,
                                  guard=False if guard is None else (guard or True))
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000.0)
    if attachment is not None:
        attachment.detach(timeout=10)
    print(json.dumps({"config": config, "ms": statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.steps, args.warmup)
        return
    results: dict[str, list[float]] = {c: [] for c in CONFIGS}
    env = {**os.environ, "AMPWATCH_SPOOL_DIR": tempfile.mkdtemp(prefix="guard-bench-")}
    for r in range(args.rounds):
        order = list(CONFIGS)
        random.Random(r).shuffle(order)
        for config in order:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", config, "--steps", str(args.steps),
                 "--warmup", str(args.warmup)], capture_output=True, text=True, env=env,
                check=True)
            results[config].append(json.loads(out.stdout.strip().splitlines()[-1])["ms"])
    agent_ms = statistics.median(results["agent"])
    plain_ms = statistics.median(results["plain"])
    foreach_ms = statistics.median(results["adamw_foreach_agent"])
    print(f"{'config':<22} {'ms/step':>8} {'vs agent':>9} {'vs plain':>9}   rounds")
    for config, values in results.items():
        ms = statistics.median(values)
        base = foreach_ms if config.startswith("adamw_foreach") else agent_ms
        print(f"{config:<22} {ms:8.2f} {ms / base:9.3f} {ms / plain_ms:9.3f}   "
              + ", ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
