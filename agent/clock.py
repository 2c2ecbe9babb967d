"""Phase timing marks: a monotonic host clock on CPU, CUDA events on the GPU.

`mark()` is cheap and never synchronises the device; a CUDA mark is an event recorded on
the current stream and is resolved to milliseconds on the worker thread (`elapsed_ms`),
which may wait for the event there, never on the training thread.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # float seconds (host) or torch.cuda.Event


class HostClock:
    """Marks are `time.perf_counter()` floats; exact on CPU where ops run synchronously."""

    def mark(self) -> Mark:
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(start: Mark, end: Mark) -> float:
        return (end - start) * 1000.0


class CudaClock:
    """Marks are timing events recorded on the current CUDA stream (no synchronisation)."""

    def mark(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed_ms(start: Mark, end: Mark) -> float:
        end.synchronize()  # worker thread only
        return float(start.elapsed_time(end))


def total_ms(clock: HostClock | CudaClock, intervals: list[tuple[Mark, Mark]]) -> float | None:
    """Sum of intervals in milliseconds, None when there were none (worker thread)."""
    if not intervals:
        return None
    return sum(clock.elapsed_ms(a, b) for a, b in intervals)
