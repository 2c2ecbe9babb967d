"""Step identity: whether the optimizer stepped, and the learning rate it used."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.collectors.base import Collector


class StepCollector(Collector):
    """`skipped` (host fact: the optimizer's step hook did not fire) and `lr` of group 0.

    A tensor learning rate is copied on the device (no synchronisation).
    """

    name = "step"
    slots = 1

    def __init__(self) -> None:
        super().__init__()
        self._lr: Any = None

    def on_step_begin(self, step: int) -> None:
        optimizer = self.watch.optimizer if self.watch else None
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        if isinstance(lr, torch.Tensor):
            self.view[0].copy_(lr.detach().reshape(()))
            self._lr = "slot"
        else:
            self._lr = None if lr is None else float(lr)

    def on_step_end(self, step: int, stepped: bool) -> None:
        self._skipped = not stepped

    def seal(self) -> Any:
        sealed = {"skipped": self._skipped, "lr": self._lr}
        self._lr = None
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        record["skipped"] = meta["skipped"]
        record["lr"] = float(host[0]) if meta["lr"] == "slot" else meta["lr"]
