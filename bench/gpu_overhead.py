"""gpu_check group 3: what the agent costs a GPT-2-small step (nanoGPT's 124M configuration,
random tokens), same-process A/B (alternating steps of a plain and a watched copy, as
bench/agent_overhead.py does on the CPU) and per process (separate processes per mode,
visited in shuffled rounds). Each step is timed from a device synchronisation to the next,
for both copies alike."""

from __future__ import annotations

import gc
import json
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from agent_overhead import alternate, summarize
from gpu_report import Context

from ampwatch import agent
from tests.agent.gpu_loops import GPT2_SMALL, TINY, Loop

TARGET = 1.01  # defaults: at most 1% slower
SCRIPT = Path(__file__).resolve().parent / "gpu_check.py"


class TimedLoop:
    """A GPT-2 loop whose `step()` returns its wall time in ms (device synchronised)."""

    BATCHES = 4

    def __init__(self, device: torch.device, precision: str, compiled: bool, batch: int,
                 smoke: bool, backend: str) -> None:
        recipe = "bf16" if precision == "bf16" else "fp16_scaler"
        self.device = device
        self.loop = Loop(recipe, device, TINY if smoke else GPT2_SMALL, batch=batch,
                         backend=backend, compile=compiled)
        self.tokens = self.loop.batches(self.BATCHES)
        self.count = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        self._sync()
        start = time.perf_counter()
        self.loop.step(self.tokens[self.count % self.BATCHES])
        self._sync()
        self.count += 1
        return (time.perf_counter() - start) * 1000.0


def _free_memory() -> None:
    """Let the previous configuration's two GPT-2 copies go before the next ones load."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_overhead(ctx: Context) -> None:
    """The defaults first (the headline: eager A/Bs, per process, compiled), then
    activations every step, then the second compiled A/B (compiling GPT-2 twice costs a
    minute)."""
    plan = [("ab", "bf16", False, 10), ("ab", "fp16", False, 10),
            ("processes", "bf16", False, 10), ("ab", "bf16", True, 10),
            ("ab", "bf16", False, 1), ("ab", "fp16", False, 1), ("ab", "fp16", True, 10)]
    if ctx.smoke:  # coverage first: eager, then compiled, then per process (2 torch imports)
        plan.sort(key=lambda item: (item[0] == "processes", item[2]))
    for kind, precision, compiled, every in plan:
        mode = "compiled" if compiled else "eager"
        sampling = "defaults" if every == 10 else "activations every step"
        name = f"{'A/B' if kind == 'ab' else 'per process'} {precision} {mode} {sampling}"
        cost = {"processes": (100, 20), "compiled": (70, 10), "eager": (25, 4)}[
            "processes" if kind == "processes" else mode]
        if ctx.smoke and compiled and precision == "fp16":
            ctx.report.add("overhead", name, "skip", "smoke: the path of the bf16 compiled "
                           "A/B (another compile of the same model would add only time)")
            continue
        if not ctx.fits(*cost):
            ctx.report.add("overhead", name, "skip", "out of time")
            continue
        _free_memory()
        try:
            if kind == "ab":
                _ab(ctx, name, precision, compiled, every)
            else:
                _processes(ctx, name, precision)
        except subprocess.TimeoutExpired:
            ctx.report.add("overhead", name, "skip", "out of time (a process ran past the "
                           "budget)")
        except Exception as exc:  # noqa: BLE001
            ctx.report.add("overhead", name, "fail", f"{type(exc).__name__}: {exc}"[:300],
                           traceback=traceback.format_exc()[-2000:])


def _judge(ctx: Context, every: int, ratio: float) -> tuple[str, str]:
    if every != 10:
        return "info", ""
    if ctx.smoke:  # a tiny model on a busy CPU: the code path, not the figure
        return "info", f"<= {TARGET:.3f}x (on a GPU)"
    return ("pass" if ratio <= TARGET else "fail"), f"<= {TARGET:.3f}x"


def _ab(ctx: Context, name: str, precision: str, compiled: bool, every: int) -> None:
    pairs, warmup = ctx.steps(30, 6), ctx.steps(5, 2)
    plain, watched = (TimedLoop(ctx.device, precision, compiled, ctx.batch, ctx.smoke,
                                ctx.compile_backend) for _ in range(2))
    attachment = agent.attach(watched.loop.call, watched.loop.scaler, server=ctx.server,
                              sample_every=every, name=f"gpu-check-{name.replace(' ', '-')}")
    ctx.runs[name] = attachment.run_id
    for _ in range(warmup):
        plain.step()
        watched.step()
    a, b = alternate(watched, plain, pairs)
    attachment.detach()
    rows = {r["config"]: r for r in summarize({"no agent": b, "agent": a}, "no agent")}
    paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
    ratio = rows["agent"]["ratio"]
    status, target = _judge(ctx, every, ratio)
    ctx.report.add("overhead", name, status,
                   f"{ratio:.3f}x median step ({rows['agent']['median_ms']:.1f} vs "
                   f"{rows['no agent']['median_ms']:.1f} ms), {rows['agent']['mean_ratio']:.3f}x "
                   f"of means, paired {paired:.3f}x; {pairs} pairs", target,
                   rows=list(rows.values()), paired=paired)


def _processes(ctx: Context, name: str, precision: str) -> None:
    rounds, steps, warmup = ctx.steps(3, 1), ctx.steps(20, 3), ctx.steps(5, 1)
    times: dict[str, list[float]] = {"baseline": [], "agent": []}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for mode in order:
            command = [sys.executable, str(SCRIPT), "--overhead-worker", mode,
                       "--precision", precision, "--steps", str(steps), "--warmup",
                       str(warmup), "--server", ctx.server, "--batch", str(ctx.batch)]
            if ctx.smoke:
                command.append("--smoke")
            out = subprocess.run(command, capture_output=True, text=True, check=True,
                                 timeout=max(10.0, ctx.budget.left() - 20))
            line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("{"))
            times[mode].extend(json.loads(line)["times"])
    rows = {r["config"]: r for r in summarize(times, "baseline")}
    ratio = rows["agent"]["ratio"]
    status, target = _judge(ctx, 10, ratio)
    ctx.report.add("overhead", name, status,
                   f"{ratio:.3f}x median step ({rows['agent']['median_ms']:.1f} vs "
                   f"{rows['baseline']['median_ms']:.1f} ms), {rows['agent']['mean_ratio']:.3f}x "
                   f"of means; {rounds} processes per mode x {steps} steps", target,
                   rows=list(rows.values()))


def overhead_worker(mode: str, precision: str, steps: int, warmup: int, server: str,
                    batch: int, smoke: bool) -> None:
    """One process of the per-process comparison: prints {"times": [...]}."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    loop = TimedLoop(device, precision, False, batch, smoke, "inductor")
    attachment = None
    if mode == "agent":
        attachment = agent.attach(loop.loop.call, loop.loop.scaler, server=server,
                                  name=f"gpu-check-per-process-{precision}")
    for _ in range(warmup):
        loop.step()
    times = [loop.step() for _ in range(steps)]
    if attachment is not None:
        attachment.detach()
    print(json.dumps({"mode": mode, "times": times}))
