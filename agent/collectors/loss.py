"""The loss of each step, as the agent sees it: the input of `scaler.scale()` (so the
unscaled loss), or without a scaler (or with a disabled one) the scalar that `backward()`
was called on. With gradient accumulation the step's loss is the sum of its micro-batch
losses."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.collectors.base import Collector


class LossCollector(Collector):
    """Keeps references to the loss tensors; sums them on the device at close (on the CPU,
    `session.host_reduce`, the worker sums them: no op on the training thread)."""

    name = "loss"
    slots = 1

    def __init__(self) -> None:
        super().__init__()
        self._losses: list[torch.Tensor] = []

    def bind(self, session: Any) -> None:
        super().bind(session)
        self._slot = self.slot(0)

    def _take(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and tensor.is_floating_point():
            self._losses.append(tensor.detach())

    def on_scale(self, outputs: Any) -> None:
        if self.session is not None and self.session.scaler_enabled:
            self._take(outputs)  # a disabled scaler returns it as is: backward() takes it

    def on_backward_begin(self, tensor: torch.Tensor) -> None:
        if self.session is not None and not self.session.scaler_enabled:
            self._take(tensor)

    def seal(self) -> Any:
        losses, self._losses = self._losses, []
        return losses

    def close(self, sealed: Any) -> Any:
        if not sealed:
            return None
        if self.session.host_reduce:
            return sealed
        self._slot.copy_(_total(sealed))
        return True

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            record["loss"] = None
        else:
            record["loss"] = float(host[0]) if meta is True else float(_total(meta))


def _total(losses: list[torch.Tensor]) -> torch.Tensor:
    """A step's loss: its one loss, or the sum of its micro-batch losses in float32."""
    return losses[0] if len(losses) == 1 else torch.stack(
        [t.float().reshape(()) for t in losses]).sum()
