"""gpu_check groups 1 and 2: no host sync from the agent in any training recipe, and the
values it records equal the truth the check takes itself (loss scale, skipped steps, grad
norms, phase times against torch.profiler, peak memory per step)."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import torch
from gpu_report import Context

from ampwatch import agent
from ampwatch.client import Client
from tests.agent.factories import same
from tests.agent.gpu_loops import (
    GPT2_SMALL,
    RECIPES,
    SYNC_MESSAGE,
    TINY,
    Loop,
    SwallowedErrors,
    allow_loop_syncs,
    fp8_unavailable,
    host_waits,
    overflow_factors,
    sync_errors,
    sync_origin,
)
from tests.agent.gpu_timing import (
    PhaseMarks,
    compare_phases,
    peak_truth_before,
    phase_ms,
    profiled_trace,
)

SAMPLE_EVERY = 10
ANOMALY_WINDOW = 20  # the agent's default sample_after_anomaly (up to: the worker sets it)
TIMING_TOLERANCE = 0.10
NORM_TOLERANCE = 1e-4  # relative: the agent's fused norms against get_total_norm


def recorded_steps(ctx: Context, run_id: str) -> dict[int, dict[str, Any]]:
    """The run's stored steps, by step (as the server answers them)."""
    with Client(ctx.server) as client:
        return {s.step: dataclasses.asdict(s) for s in client.steps(run_id)}


def sampled_steps(ctx: Context, run_id: str, layer: str = "h.0.attn.c_attn") -> set[int]:
    """The steps whose activations the server holds for `layer`: the sampled ones."""
    with Client(ctx.server) as client:
        return {point.step for point in client.layer_series(run_id, layer).activations}


def check_no_sync(ctx: Context) -> None:
    """Group 1: each recipe trains under the sync debug mode with the agent attached."""
    for recipe in RECIPES:
        reason = fp8_unavailable(ctx.device) if recipe == "fp8_torchao" else None
        cost = (25, 10) if recipe == "compiled" else (8, 3)
        if reason is None and not ctx.fits(*cost):
            reason = "out of time"
        if reason is not None:
            ctx.report.add("no-sync", recipe, "skip", reason)
            continue
        try:
            _no_sync(ctx, recipe)
        except Exception as exc:  # noqa: BLE001 - one recipe's failure is its row
            ctx.report.add("no-sync", recipe, "fail", f"{type(exc).__name__}: {exc}"[:300],
                           traceback=traceback.format_exc()[-2000:])


def _no_sync(ctx: Context, recipe: str) -> None:
    device = ctx.device
    loop = Loop(recipe, device, TINY, batch=4, backend=ctx.compile_backend)
    steps, warmup = ctx.steps(100, 12), 3
    overflow = steps // 3 if loop.scaler is not None and loop.scaler.is_enabled() else None
    tokens = loop.batches(warmup + steps)
    factors = overflow_factors(warmup + steps, None if overflow is None else warmup + overflow,
                               device)
    attachment = agent.attach(loop.call, loop.scaler, server=ctx.server,
                              name=f"gpu-check-sync-{recipe}", sample_every=SAMPLE_EVERY)
    ctx.runs[f"sync {recipe}"] = attachment.run_id
    loop_syncs: list[str] = []
    with SwallowedErrors() as swallowed:
        for i in range(warmup):  # compiles, first allocations: not checked
            loop.step(tokens[i], factors[i])
        allow_loop_syncs(loop.scaler, device)
        with host_waits() as waits:
            for i in range(warmup, warmup + steps):
                try:
                    with sync_errors(device):
                        loop.step(tokens[i], factors[i])
                except RuntimeError as exc:
                    origin = sync_origin(exc)
                    if origin is None:
                        raise
                    loop_syncs.append(f"step {i}: {origin}")
                    break  # the step stopped half-way: later steps would not be the recipe
        delivered = attachment.flush(60)
        attachment.detach()
    records = recorded_steps(ctx, attachment.run_id)
    agent_syncs = swallowed.syncs + [(s, "") for s in loop_syncs if ": agent: " in s]
    other = [e for e in swallowed.errors if SYNC_MESSAGE not in e[1]]
    checked_sampled = sorted(i for i in sampled_steps(ctx, attachment.run_id)
                             if i >= warmup)
    sampled = (f"{len(checked_sampled)} of the checked steps"
               + (" (a compiled model is never sampled)" if loop.compiled else
                  f" (every {SAMPLE_EVERY}th, and up to {ANOMALY_WINDOW} after an anomaly"
                  + (f" such as the overflow at step {warmup + overflow}" if overflow else "")
                  + ")"))
    ok = (not agent_syncs and not loop_syncs and not other and not waits and delivered
          and len(records) == warmup + steps and (loop.compiled or bool(checked_sampled)))
    status = "pass" if ok else "fail"
    if device.type != "cuda":
        status = "skip" if ok else "fail"
    ctx.report.add(
        "no-sync", recipe, status,
        (f"{len(agent_syncs)} agent syncs, {len(loop_syncs)} raised, {len(waits)} host waits "
         f"on the training thread in {steps} checked steps; "
         f"{len(records)}/{warmup + steps} steps stored; sampled: {sampled}"
         + ("" if device.type == "cuda" else "; the sync debug mode is CUDA only: the "
            "code path ran, nothing was checked")),
        "0 agent syncs, 0 waits", agent_syncs=agent_syncs[:20], loop_syncs=loop_syncs[:20],
        host_waits=waits[:20], sampled_steps=checked_sampled,
        other_errors=other[:20], delivered=delivered)


def check_values(ctx: Context) -> None:
    """Group 2: exact values, phase times against torch.profiler, peak memory per step."""
    for name, fn in (("fp16 GradScaler", _values_fp16), ("bf16 no scaler", _peak_bf16)):
        if not ctx.fits(40, 5):
            ctx.report.add("values", name, "skip", "out of time")
            continue
        try:
            fn(ctx)
        except Exception as exc:  # noqa: BLE001
            ctx.report.add("values", name, "fail", f"{type(exc).__name__}: {exc}"[:300],
                           traceback=traceback.format_exc()[-2000:])


def _values_fp16(ctx: Context) -> None:
    device = ctx.device
    cuda = device.type == "cuda"
    # on a GPU, a model whose phases keep the GPU busy (8k tokens a step), so CUDA events
    # and kernel spans measure the same thing; on the CPU a tiny one
    config, batch = (GPT2_SMALL, max(1, ctx.batch // 2)) if cuda else (TINY, 4)
    loop = Loop("fp16_scaler", device, config, batch=batch)
    warmup, profiled = ctx.steps(4, 3), ctx.steps(6, 5)
    n = warmup + profiled
    tokens, factors = loop.batches(n), overflow_factors(n, 1, device)
    # the overflow's anomaly window (3 steps) samples the first profiled step, the rest
    # are ordinary steps: timings are compared on both kinds
    attachment = agent.attach(loop.call, loop.scaler, server=ctx.server,
                              name="gpu-check-values", sample_every=SAMPLE_EVERY,
                              sample_after_anomaly=3)
    ctx.runs["values fp16"] = attachment.run_id
    marks, refs, stepped = PhaseMarks(), [], []
    loop.optimizer.register_step_post_hook(lambda *a: stepped.__setitem__(-1, True))

    def run(i: int) -> None:
        marks.step = i
        ref = {"loss_scale": loop.scaler.get_scale()}  # the truth may synchronise

        def grad_norm() -> None:
            grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
            ref["grad_norm"] = float(torch.nn.utils.get_total_norm(grads))

        stepped.append(False)
        loop.step(tokens[i], factors[i], mark=marks.mark, on_unscaled=grad_norm)
        refs.append(ref)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # step 0's peak starts here
    with SwallowedErrors() as swallowed, peak_truth_before(loop.scaler, loop.optimizer,
                                                           device) as peaks:
        for i in range(warmup):
            run(i)
        trace = profiled_trace(lambda: [run(i) for i in range(warmup, n)], device)
        delivered = attachment.flush(60)
    attachment.detach()
    records = recorded_steps(ctx, attachment.run_id)
    report = ctx.report
    bad = [i for i in range(n) if i not in records
           or records[i]["loss_scale"] != refs[i]["loss_scale"]
           or records[i]["skipped"] != (not stepped[i])]
    report.add("values", "loss scale and skipped steps (fp16)", "fail" if bad else "pass",
               f"{n - len(bad)}/{n} steps equal (skipped: "
               f"{[i for i in range(n) if not stepped[i]]})", "every step equal",
               mismatched=bad, delivered=delivered, errors=swallowed.errors[:20])
    bad = [i for i in range(n) if i not in records or not same(
        records[i]["grad_norm"], refs[i]["grad_norm"], rel=NORM_TOLERANCE)]
    report.add("values", "grad norm (fp16, unscaled)", "fail" if bad else "pass",
               f"{n - len(bad)}/{n} steps within {NORM_TOLERANCE:g}",
               f"relative {NORM_TOLERANCE:g}", mismatched=[
                   (i, records.get(i, {}).get("grad_norm"), refs[i]["grad_norm"]) for i in bad])
    for phase, result in compare_phases(phase_ms(trace, device), records).items():
        median = result["median"]
        status = ("fail" if median is None or median > TIMING_TOLERANCE
                  or result["steps"] < profiled else "pass")
        clock = "CUDA events" if cuda else "host clock"
        report.add("values", f"{phase} time vs torch.profiler ({clock})", status,
                   "no comparable steps" if median is None else
                   f"median diff {median:.1%}, worst {result['worst']:.1%} over "
                   f"{result['steps']} steps; agent {result['agent_ms']:.1f} ms, profiler "
                   f"{result['profiler_ms']:.1f} ms", f"within {TIMING_TOLERANCE:.0%}",
                   **result)
    _report_peaks(ctx, "fp16 GradScaler", records, peaks, n)


def _report_peaks(ctx: Context, label: str, records: dict[int, dict[str, Any]],
                  peaks: list[int], n: int) -> None:
    name = f"peak memory per step ({label})"
    if ctx.device.type != "cuda":
        stored = [records.get(i, {}).get("peak_mem_bytes") for i in range(n)]
        ctx.report.add("values", name, "skip" if stored == [None] * n else "fail",
                       f"CUDA only (the agent records none on the CPU: {set(stored)})")
        return
    bad = [(i, records.get(i, {}).get("peak_mem_bytes"), peaks[i]) for i in range(n)
           if i >= len(peaks) or records.get(i, {}).get("peak_mem_bytes") != peaks[i]]
    ctx.report.add("values", name, "fail" if bad else "pass",
                   f"{n - len(bad)}/{n} steps equal max_memory_allocated "
                   f"(largest {max(peaks) / 2**20:.0f} MiB)", "every step equal",
                   mismatched=bad[:20])


def _peak_bf16(ctx: Context) -> None:
    """Without a scaler the agent closes a step in the optimizer's post-hook: the peak
    truth is read in a per-optimizer post-hook, which runs just before it."""
    device = ctx.device
    loop = Loop("bf16", device, TINY, batch=4)
    n = 6
    tokens = loop.batches(n)
    attachment = agent.attach(loop.call, None, server=ctx.server, name="gpu-check-peak-bf16")
    ctx.runs["values bf16"] = attachment.run_id
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with peak_truth_before(None, loop.optimizer, device) as peaks:
        for i in range(n):
            loop.step(tokens[i])
        attachment.flush(60)
    attachment.detach()
    _report_peaks(ctx, "bf16, no scaler", recorded_steps(ctx, attachment.run_id), peaks, n)
