"""GradScaler state: the loss scale each step's backward used and the scale update() set."""

from __future__ import annotations

from typing import Any

import numpy as np

from ampwatch.agent.collectors.base import Collector


class ScalerCollector(Collector):
    """`loss_scale` is the scaler's scale tensor copied on the device when the step begins
    (nothing changes it before that step's `update()`); `scale_after` is copied right
    after `update()`. Never calls `get_scale()`, which synchronises."""

    name = "scaler"
    slots = 2

    def __init__(self) -> None:
        super().__init__()
        self._before = False
        self._after = False

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._slot_before, self._slot_after = self.slot(0), self.slot(1)

    def _scale_tensor(self) -> Any:
        scaler = self.watch.scaler if self.watch else None
        if scaler is None or not getattr(scaler, "_enabled", True):
            return None
        return getattr(scaler, "_scale", None)

    def on_step_begin(self, step: int) -> None:
        scale = self._scale_tensor()
        self._before = scale is not None
        if scale is not None:
            self._slot_before.copy_(scale)  # 1 element

    def seal(self) -> Any:
        before, self._before = self._before, False
        self._after = False
        return before

    def on_update_end(self, closing: bool) -> None:
        scale = self._scale_tensor()
        if closing and scale is not None:
            self._slot_after.copy_(scale)
            self._after = True

    def close(self, sealed: Any) -> Any:
        after, self._after = self._after, False
        return {"before": bool(sealed), "after": after}

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        record["loss_scale"] = float(host[0]) if meta["before"] else None
        record["scale_after"] = float(host[1]) if meta["after"] else None
