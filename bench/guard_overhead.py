"""What the step guard (attach(guard=...), docs/guard.md) costs a training step on the CPU.

The GPT of bench/agent_overhead.py (~4M parameters, seq 64, batch 2), bf16 autocast
without a scaler, clip_grad_norm_, AdamW, one torch thread, the agent offline without the
flight recorder. Paired in one process: two copies of the model (same weights, same
batches), both attached, one with the guard and one without, stepped in turn (ABBA, so
drift cancels); each pair gives a ratio, the table their median, once with the guarded
copy attached second and once first, and the geometric mean of the two. Both copies run
both attachments' global hooks, so the ratio is the guard's own cost. A null pair (no
guard on either side) shows the noise floor. `hooks ms`: the time a step spends inside
the guard's own optimizer hooks (decision, copies, restore), which this shared machine's
noise does not blur; found_inf's work inside the fused optimizer is not in it.

    python bench/guard_overhead.py --pairs 40

Configurations: null (no guard on either), guard_auto (fused AdamW: its found_inf),
guard_select (the device-side copy and torch.where, what an accelerator with an unfused
optimizer gets), guard_sync (one host read a step), guard_spikes (auto with
skip_spikes=5), foreach_auto (an unfused AdamW, for which "auto" means sync on the CPU).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
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

CONFIGS: dict[str, tuple[object, bool]] = {
    # name: (the guarded copy's guard option, fused AdamW)
    "null": (False, True),
    "guard_auto": (True, True),
    "guard_select": ({"mode": "select"}, True),
    "guard_sync": ({"mode": "sync"}, True),
    "guard_spikes": ({"skip_spikes": 5}, True),
    "foreach_auto": (True, False),
}


class Copy:
    """One attached copy of the model and its optimizer; `step()` is the timed unit."""

    def __init__(self, guard: object, fused: bool) -> None:
        from ampwatch import agent

        torch.manual_seed(0)
        self.model = GPT()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=fused,
                                           foreach=None if fused else True)
        self.attachment = agent.attach(self.model, offline=True, record=False, guard=guard)
        self.hook_s = 0.0  # time inside the guard's own optimizer hooks
        step_guard = self.attachment.step_guard
        if step_guard is not None:  # timed before the first step registers them
            for name in ("_arm", "_disarm"):
                setattr(step_guard, name, self._timed(getattr(step_guard, name)))

    def _timed(self, hook):  # noqa: ANN001, ANN202
        def timed(*args):  # noqa: ANN002, ANN202
            start = time.perf_counter()
            try:
                return hook(*args)
            finally:
                self.hook_s += time.perf_counter() - start
        return timed

    def step(self, idx: torch.Tensor) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1000.0


def measure(config: str, pairs: int, warmup: int, guarded_first: bool) -> dict:
    guard, fused = CONFIGS[config]
    if guarded_first:
        guarded, base = Copy(guard, fused), Copy(False, fused)
    else:
        base, guarded = Copy(False, fused), Copy(guard, fused)
    gen = torch.Generator().manual_seed(0)
    ratios, base_ms, guard_ms = [], [], []
    for i in range(warmup + pairs):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        if i % 2:
            g, b = guarded.step(idx), base.step(idx)
        else:
            b, g = base.step(idx), guarded.step(idx)
        if i >= warmup:
            ratios.append(g / b)
            base_ms.append(b)
            guard_ms.append(g)
    for copy in (base, guarded):
        copy.attachment.detach(timeout=10)
    hooks_ms = guarded.hook_s * 1000.0 / (warmup + pairs)
    return {"config": config, "ratio": statistics.median(ratios),
            "base_ms": statistics.median(base_ms), "guard_ms": statistics.median(guard_ms),
            "hooks_ms": hooks_ms, "q1": statistics.quantiles(ratios, n=4)[0],
            "q3": statistics.quantiles(ratios, n=4)[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("AMPWATCH_SPOOL_DIR", tempfile.mkdtemp(prefix="guard-bench-"))
    torch.set_num_threads(1)
    print(f"{'config':<14} {'no guard ms':>11} {'guard ms':>9} {'ratio':>7} {'hooks ms':>8}  "
          "ratio (IQR): guard attached second, first")
    for config in CONFIGS:
        # each order of attaching once: the geometric mean cancels any order effect
        rows = [measure(config, args.pairs, args.warmup, first) for first in (False, True)]
        ratio = math.sqrt(rows[0]["ratio"] * rows[1]["ratio"])
        print(f"{config:<14} {statistics.median([r['base_ms'] for r in rows]):11.2f} "
              f"{statistics.median([r['guard_ms'] for r in rows]):9.2f} {ratio:7.3f} "
              f"{statistics.mean([r['hooks_ms'] for r in rows]):8.2f}  "
              + "  ".join(f"{r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})" for r in rows),
              flush=True)


if __name__ == "__main__":
    main()
