"""The truth for the agent's phase timings and peak memory, taken independently of it.

Phase times come from `torch.profiler`: the loop marks each phase with `record_function`
(`ampwatch.<phase>.<step>`). On the CPU a phase's time is that range's host duration, as
the agent's host clock measures it. On CUDA the agent's CUDA events measure the stream's
timeline between the phase's start and end marks, so the comparable figure is the GPU
span of the work the phase launched: from the first start to the last end of the kernels,
copies and memsets whose launch (a runtime or driver call, on any thread: backward
launches from autograd's device thread) lies inside the range, joined by the profiler's
correlation ids; GPU work whose launch the trace lacks goes with the work just before it
on the GPU. Both agree when the GPU, not the launching, is the bottleneck.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import re
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("forward", "backward", "optimizer")
AGENT_FIELDS = {"forward": "t_forward_ms", "backward": "t_backward_ms",
                "optimizer": "t_optimizer_ms"}
_RANGE = re.compile(r"^ampwatch\.(\w+)\.(\d+)$")
_LAUNCHES = ("cuda_runtime", "cuda_driver")
_GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


class PhaseMarks:
    """`mark(phase)` context managers named for the current `step` (set by the loop)."""

    def __init__(self) -> None:
        self.step = 0

    def mark(self, phase: str) -> contextlib.AbstractContextManager:
        return record_function(f"ampwatch.{phase}.{self.step}")


def profiled_trace(run: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run `run` under torch.profiler (CPU, and CUDA activity on a GPU); the Chrome trace."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def phase_ms(trace: dict[str, Any], device: torch.device) -> dict[tuple[str, int], float]:
    """(phase, step) -> milliseconds, summed over the step's ranges of that phase (one per
    micro-batch)."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], m.group(1), int(m.group(2))) for e in events
                    if e.get("cat") == "user_annotation"
                    and (m := _RANGE.match(e.get("name", ""))))
    out: dict[tuple[str, int], float] = defaultdict(float)
    if device.type != "cuda":
        for start, end, phase, step in ranges:
            out[(phase, step)] += (end - start) / 1000.0
        return dict(out)
    starts = [r[0] for r in ranges]
    owner: dict[int, int | None] = {}  # correlation id -> index of the range it launched in
    for e in events:
        if e.get("cat") in _LAUNCHES and "correlation" in e.get("args", {}):
            i = bisect.bisect_right(starts, e["ts"]) - 1
            owner[e["args"]["correlation"]] = (
                i if i >= 0 and e["ts"] <= ranges[i][1] else None)
    work = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
                  for e in events if e.get("cat") in _GPU_WORK)
    spans: dict[int, list[float]] = {}
    current: int | None = None
    for start, end, correlation in work:
        if correlation in owner:
            current = owner[correlation]
        # else a launch the trace did not record (a library's own driver call): the work
        # belongs with what ran just before it on the GPU
        if current is not None:
            first, last = spans.get(current, (start, end))
            spans[current] = [min(first, start), max(last, end)]
    for index, (first, last) in spans.items():
        _, _, phase, step = ranges[index]
        out[(phase, step)] += (last - first) / 1000.0
    return dict(out)


def compare_phases(truth: dict[tuple[str, int], float], recorded: dict[int, dict[str, Any]]
                   ) -> dict[str, dict[str, Any]]:
    """Per phase: the relative differences |agent - profiler| / profiler over the steps
    both have (median, worst, how many steps, both totals)."""
    out = {}
    for phase in PHASES:
        diffs, agent_total, truth_total = [], 0.0, 0.0
        for (name, step), reference in sorted(truth.items()):
            value = recorded.get(step, {}).get(AGENT_FIELDS[phase])
            if name != phase or value is None or reference <= 0:
                continue
            diffs.append(abs(value - reference) / reference)
            agent_total += value
            truth_total += reference
        out[phase] = {"steps": len(diffs),
                      "median": statistics.median(diffs) if diffs else None,
                      "worst": max(diffs) if diffs else None,
                      "agent_ms": agent_total, "profiler_ms": truth_total}
    return out


@contextlib.contextmanager
def peak_truth_before(scaler: Any, optimizer: Any, device: torch.device
                      ) -> Iterator[list[int]]:
    """Each step's peak allocated bytes, read as late as possible before the agent reads
    and resets it: just before the agent-wrapped `scaler.update()` (where it closes a step
    with a scaler), or in a per-optimizer step post-hook, which runs before the agent's
    global one (where it closes a step without). The caller resets the peak once before
    the first step; the agent's resets delimit the steps after. CUDA only."""
    peaks: list[int] = []

    def read(*args: Any, **kwargs: Any) -> None:
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device))

    handle = None
    if scaler is not None:
        agent_update = scaler.update

        def update(*args: Any, **kwargs: Any) -> Any:
            read()
            return agent_update(*args, **kwargs)

        scaler.update = update
    else:
        handle = optimizer.register_step_post_hook(read)
    try:
        yield peaks
    finally:
        if handle is not None:
            handle.remove()
        if scaler is not None:
            scaler.update = agent_update
