"""The loss of each step: the losses the loop backpropagated into the watched model since
its previous step, summed (the micro-batches of gradient accumulation, the several losses
of a multi-task or multi-model loop), each once and unscaled: with a GradScaler, the loss
given to the `scaler.scale()` whose output was backpropagated. A backward that does not
reach the model (another model's loss) adds nothing, and neither does one whose grads the
loop dropped with `zero_grad` before the step. `attachment.log_loss()` replaces all that
with the losses the loop names itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.collectors.base import Collector


class LossCollector(Collector):
    """Keeps references to the loss tensors; sums them on the device at close (on the CPU,
    `watch.host_reduce`, the worker sums them: no op on the training thread)."""

    name = "loss"
    slots = 1

    def __init__(self) -> None:
        super().__init__()
        self._losses: list[torch.Tensor] = []
        self._named: list[torch.Tensor | float] = []  # attachment.log_loss(): these win

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._slot = self.slot(0)

    def _take(self, tensor: Any, into: list[Any]) -> None:
        if isinstance(tensor, torch.Tensor):
            if tensor.numel() == 1 and tensor.is_floating_point():
                into.append(tensor.detach())
        elif isinstance(tensor, (float, int)) and not isinstance(tensor, bool):
            into.append(float(tensor))  # added on the worker: no host-to-device copy

    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        self._take(loss, self._losses)

    def on_zero_grad(self) -> None:
        self._losses.clear()

    def on_loss_logged(self, loss: Any) -> None:
        self._take(loss, self._named)

    def seal(self) -> Any:
        losses = self._named or self._losses
        self._losses, self._named = [], []
        return losses

    def close(self, sealed: Any) -> Any:
        """(the tensors' part: True when summed into the slot, else the tensors for the
        worker; the Python numbers' sum)."""
        if not sealed:
            return None
        tensors = [t for t in sealed if isinstance(t, torch.Tensor)]
        numbers = sum(x for x in sealed if not isinstance(x, torch.Tensor))
        if tensors and not self.watch.host_reduce:
            self._slot.copy_(_total(tensors))
            return True, numbers
        return tensors, numbers

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            record["loss"] = None
            return
        tensors, numbers = meta
        if tensors is True:
            numbers += float(host[0])
        elif tensors:
            numbers += float(_total(tensors))
        record["loss"] = numbers


def _total(losses: list[torch.Tensor]) -> torch.Tensor:
    """A step's loss: its one loss, or the sum of its losses in float32."""
    return losses[0] if len(losses) == 1 else torch.stack(
        [t.float().reshape(()) for t in losses]).sum()
