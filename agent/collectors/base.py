"""The one protocol every signal implements.

A collector reserves slots in the step buffer, reacts to the training loop's events on
the training thread (never synchronising the device: it only launches device work into
its slots and keeps host facts), and turns its slots of the host copy into wire fields
on the worker thread, a step later. Adding a signal means adding one collector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ampwatch.agent.buffer import StepBuffer
    from ampwatch.agent.loop_watch import LoopWatch

EVENTS = ("on_forward_begin", "on_forward_end", "on_backward_begin", "on_backward_end",
          "on_zero_grad", "on_loss_logged", "on_scale", "on_grads", "on_grads_rewritten",
          "on_clip_begin",
          "on_clip_end", "on_scheduler_step",
          "on_step_begin", "on_step_end", "on_update_begin", "on_update_end", "on_next_step")


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`: a CUDA one is copied from pinned memory without
    waiting for the device (a pageable copy, as `torch.tensor(..., device=)` makes, would
    block the host until the device caught up)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class Collector:
    """Base class: every event is a no-op; subclasses override the ones they need.

    Training-thread methods do not synchronise the device. `read` runs on the worker.
    """

    name = "collector"
    slots = 0

    def __init__(self) -> None:
        self.offset = 0
        self.watch: LoopWatch | None = None

    # set-up (training thread, at attach and detach)
    def reserve(self, buffer: StepBuffer) -> None:
        self.offset = buffer.reserve(self.slots)

    def bind(self, watch: LoopWatch) -> None:
        self.watch = watch
        self._view = watch.buffer.view(self.offset, self.slots)  # one narrow, not per step

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a 1-element view (copy_ of a 0-d or 1-element tensor fills it)."""
        return self._view.narrow(0, index, 1)

    def unbind(self) -> None:
        """Remove whatever hooks the collector registered itself."""

    @property
    def view(self) -> torch.Tensor:
        assert self.watch is not None
        return self._view

    # per step (training thread): seal() hands over this step's host state at step end;
    # close() writes the device values of a sealed step into the slots, returns host meta
    def seal(self) -> Any:
        return None

    def close(self, sealed: Any) -> Any:
        return sealed

    # worker thread: fill wire fields of the step record from the host copy
    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        """Add this collector's fields to `record` (worker thread)."""

    # events (training thread); see agent.loop_watch for when each fires
    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None: ...
    def on_forward_end(self, training: bool, output: Any) -> None: ...
    # the model's own backwards only (agent/attribution.py); `loss` is the unscaled loss
    # backpropagated, None when the agent cannot tell it (a non-scalar backward)
    def on_backward_begin(self, loss: torch.Tensor | None) -> None: ...
    def on_backward_end(self) -> None: ...
    def on_zero_grad(self) -> None: ...  # the model's grads were dropped: so is what made them
    def on_loss_logged(self, loss: Any) -> None: ...  # attachment.log_loss()
    def on_scale(self, outputs: Any) -> None: ...
    # the grads as the model's backward left them (each backward: the last before the step
    # wins); `divisor`: the scale they still carry (device tensor), None when unscaled;
    # `norms`: their norms (float64, not divided), None when the collector takes its own
    def on_grads(self, grads: list[torch.Tensor], present: tuple[int, ...],
                 divisor: torch.Tensor | None, norms: torch.Tensor | None) -> None: ...
    # at the step, the grads were rewritten since on_grads by something the agent did not
    # see called (a hand-written clip): as the optimizer gets them
    def on_grads_rewritten(self, grads: list[torch.Tensor],
                           divisor: torch.Tensor | None) -> None: ...
    def on_clip_begin(self, unscaled: bool) -> None: ...
    def on_clip_end(self, total_norm: Any, max_norm: float, unscaled: bool) -> None: ...
    def on_scheduler_step(self, optimizer: Any) -> None: ...
    def on_step_begin(self, step: int) -> None: ...
    def on_step_end(self, step: int, stepped: bool) -> None: ...
    def on_update_begin(self) -> None: ...
    def on_update_end(self, closing: bool) -> None: ...
    def on_next_step(self, step: int) -> None: ...
    # after the watch ended an optimizer step, outside the error boundary: it may raise
    # into the loop on purpose (only the step guard's GuardStop does)
    def after_step(self) -> None: ...


def overrides(collector: Collector, event: str) -> bool:
    return getattr(type(collector), event) is not getattr(Collector, event)


class SampledHooks:
    """Hooks that exist only on sampled steps: `want()` as each step is set up (the loop watch's
    `on_next_step`), `ensure()` as each forward begins. They go on as a sampled step's first
    forward begins and come off as the next unsampled step is set up, so all their cost
    falls on the sampled step itself, not on the step before it."""

    def __init__(self, register: Callable[[], list[Any]]) -> None:
        self._register = register  # registers the hooks; returns their handles
        self._wanted = False
        self._handles: list[Any] = []

    def want(self, on: bool) -> None:
        self._wanted = on
        if not on:
            self.remove()

    def ensure(self) -> None:
        if self._wanted and not self._handles:
            self._handles = self._register()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
