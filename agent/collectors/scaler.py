"""GradScaler state: the loss scale each step's backward used and the scale update() set."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.collectors.base import Collector


class ScalerCollector(Collector):
    """`loss_scale` is the scaler's scale tensor copied on the device when the step begins
    (nothing changes it before that step's `update()`); `scale_after` is copied right
    after `update()`. Never calls `get_scale()`, which synchronises. A scale held in host
    memory (a CPU scaler) is read as it is, a step's values travel in its meta."""

    name = "scaler"
    slots = 2

    def __init__(self) -> None:
        super().__init__()
        self._before: float | bool | None = None
        self._after: float | bool | None = None

    def bind(self, session: Any) -> None:
        super().bind(session)
        self._slot_before, self._slot_after = self.slot(0), self.slot(1)

    def _scale_tensor(self) -> Any:
        scaler = self.session.scaler if self.session else None
        if scaler is None or not getattr(scaler, "_enabled", True):
            return None
        return getattr(scaler, "_scale", None)

    def _take(self, scale: torch.Tensor, slot: torch.Tensor) -> float | bool:
        """The scale's value (a host tensor: reading it waits for no device), or True once
        it is copied into `slot` on the device."""
        if scale.is_cpu:
            return scale.item()
        slot.copy_(scale)  # 1 element
        return True

    def on_step_begin(self, step: int) -> None:
        scale = self._scale_tensor()
        self._before = None if scale is None else self._take(scale, self._slot_before)

    def seal(self) -> Any:
        before, self._before = self._before, None
        self._after = None
        return before

    def on_update_end(self, closing: bool) -> None:
        scale = self._scale_tensor()
        if closing and scale is not None:
            self._after = self._take(scale, self._slot_after)

    def close(self, sealed: Any) -> Any:
        after, self._after = self._after, None
        return {"before": sealed, "after": after}

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        record["loss_scale"] = _value(meta["before"], host[0])
        record["scale_after"] = _value(meta["after"], host[1])


def _value(taken: float | bool | None, slot: float) -> float | None:
    """A value from `ScalerCollector._take` (None: not taken; True: in the slot)."""
    return None if taken is None else float(slot) if taken is True else taken
