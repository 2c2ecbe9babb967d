"""What the flight recorder costs: steady state on healthy runs, and one capture.

1. On versus off, in one process: two attached copies of bench/agent_overhead.py's GPT
   (~4M parameters, bf16 autocast, GradScaler, AdamW, one torch thread), one with
   `record=True`, one with `record=False`, alternating steps (same weights, same
   batches); the median of per-pair step-time ratios. Also what the recorder holds:
   bytes of the batch per step, steps in flight at most, the RNG state copied per step.
2. One capture on a ~100M-parameter model on the CPU (an MLP of 3072-wide Linears,
   fp16 autocast, GradScaler): a NaN batch at the last step; the time the training
   thread spends copying the weights, the writer thread's time to serialise and write,
   and the bundle's bytes.

Offline (the spool only): no server is involved in either number.

    python bench/recorder_cost.py --steps 100
"""

from __future__ import annotations

import argparse
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

from bench.agent_overhead import Trainer, alternate  # noqa: E402


def recorder_of(attachment):
    return next(c for c in attachment._watch.collectors if c.name == "recorder")


def steady_state(steps: int, warmup: int) -> None:
    from ampwatch import agent

    on_copy, off_copy = Trainer(), Trainer()
    on = agent.attach(on_copy.model, on_copy.scaler, name="bench-record-on", record=True)
    off = agent.attach(off_copy.model, off_copy.scaler, name="bench-record-off", record=False)
    recorder = recorder_of(on)
    in_flight = []
    original_seal = recorder.seal

    def seal():
        held = original_seal()
        in_flight.append(recorder._sealed - recorder._read)
        return held

    recorder.seal = seal
    for _ in range(warmup):
        on_copy.step()
        off_copy.step()
    a, b = alternate(on_copy, off_copy, steps)
    on.detach()
    off.detach()
    ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
    print(f"healthy run, {steps} alternating pairs: median step {statistics.median(b):.2f} ms "
          f"recording off, {statistics.median(a):.2f} ms on; median per-pair ratio "
          f"on/off {ratio:.3f}")
    batch = 2 * 65 * 8  # the GPT's (BATCH, SEQ + 1) int64 token batch, held by reference
    rng = torch.get_rng_state().numel()
    print(f"held per step: a reference to the batch ({batch} bytes here) and a copy of "
          f"the CPU RNG state ({rng} bytes); steps in flight at most {max(in_flight)} "
          f"(median {statistics.median(in_flight):.0f}); bundles written: "
          f"{len(recorder.captured)}")


def one_capture(width: int, depth: int) -> None:
    from ampwatch import agent

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 16))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    attachment = agent.attach(model, scaler, name="bench-capture", sample_every=0)
    recorder = recorder_of(attachment)
    timings: dict[str, float] = {}
    capture, write = recorder._capture, recorder.writer._write

    def timed_capture(held, meta):
        start = time.perf_counter()
        capture(held, meta)
        timings["capture_s"] = time.perf_counter() - start

    def timed_write(meta, state):
        start = time.perf_counter()
        write(meta, state)
        timings["write_s"] = time.perf_counter() - start

    recorder._capture, recorder.writer._write = timed_capture, timed_write
    for step in range(4):
        x = torch.randn(8, width)
        if step == 3:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach(timeout=300)
    (meta,) = recorder.captured
    print(f"one capture, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB fp32) "
          f"on the CPU: training thread {timings['capture_s'] * 1000:.0f} ms (copying the "
          f"weights), writer thread {timings['write_s']:.2f} s, bundle "
          f"{meta['bytes'] / 2**20:.1f} MiB, step {meta['step']}, {meta['trigger']}, "
          f"exact {meta['params']['exact']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--depth", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("AMPWATCH_MODE", "offline")
    os.environ.setdefault("AMPWATCH_SPOOL_DIR", tempfile.mkdtemp(prefix="recorder-bench-"))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread, "
          f"load average {os.getloadavg()[0]:.1f}")
    steady_state(args.steps, args.warmup)
    one_capture(args.width, args.depth)


if __name__ == "__main__":
    main()
