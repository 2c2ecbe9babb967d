"""Phase timings (backward, optimizer, whole step) and peak device memory.

Marks come from the loop watch's clock (host monotonic clock on CPU, CUDA events on the
GPU), resolved on the worker. Peak memory is `torch.cuda.max_memory_allocated`, reset
after each step so that it is the step's own peak (null on CPU); neither synchronises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.clock import total_ms
from ampwatch.agent.collectors.base import Collector


class TimingCollector(Collector):
    """`t_backward_ms`, `t_optimizer_ms`, `t_step_ms`, `peak_mem_bytes`."""

    name = "timing"

    def __init__(self) -> None:
        super().__init__()
        self._backward: list[tuple[Any, Any]] = []
        self._backward_start: Any = None
        self._step_start: Any = None
        self._optimizer: tuple[Any, Any] | None = None
        self._previous_end: Any = None
        self._step: tuple[Any, Any] | None = None

    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        self._backward_start = self.watch.clock.mark()

    def on_backward_end(self) -> None:
        if self._backward_start is not None:
            self._backward.append((self._backward_start, self.watch.clock.mark()))
            self._backward_start = None

    def on_zero_grad(self) -> None:
        self._backward.clear()  # the time of backwards whose grads the loop dropped

    def on_step_begin(self, step: int) -> None:
        self._step_start = self.watch.clock.mark()

    def on_step_end(self, step: int, stepped: bool) -> None:
        end = self.watch.clock.mark()
        self._optimizer = (self._step_start, end) if self._step_start is not None else None
        self._step = (self._previous_end, end) if self._previous_end is not None else None
        self._previous_end = end

    def seal(self) -> Any:
        sealed = {"backward": self._backward, "optimizer": self._optimizer, "step": self._step}
        self._backward, self._optimizer, self._step = [], None, None
        return sealed

    def close(self, sealed: Any) -> Any:
        device = self.watch.device
        if device.type == "cuda":
            sealed["peak"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            sealed["peak"] = None
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        clock = self.watch.clock
        record["t_backward_ms"] = total_ms(clock, meta["backward"])
        record["t_optimizer_ms"] = total_ms(clock, [meta["optimizer"]] if meta["optimizer"]
                                            else [])
        record["t_step_ms"] = total_ms(clock, [meta["step"]] if meta["step"] else [])
        record["peak_mem_bytes"] = meta["peak"]
