"""Loop facts behind the AMP pitfalls: LR scheduler steps and `scaler.update()` calls
since the previous optimizer step, and clipping of still-scaled grads. Host only."""

from __future__ import annotations

from typing import Any

import numpy as np

from ampwatch.agent.collectors.base import Collector


class PitfallCollector(Collector):
    """`scheduler_steps`, `scaler_updates` (null without a scaler), `clip_before_unscale`.

    Counters cover the calls after the previous optimizer step up to this one, so the
    `scheduler.step()` that follows a skipped step N is counted in step N+1's record.
    """

    name = "pitfalls"

    def __init__(self) -> None:
        super().__init__()
        self._scheduler_steps = 0
        self._updates = 0
        self._clip_scaled = False

    def on_scheduler_step(self, optimizer: Any) -> None:
        ours = self.watch.optimizer
        if optimizer is None or ours is None or optimizer is ours:
            self._scheduler_steps += 1

    def on_update_begin(self) -> None:
        self._updates += 1

    def on_clip_begin(self, unscaled: bool) -> None:
        self._clip_scaled = self._clip_scaled or not unscaled

    def seal(self) -> Any:
        sealed = {"scheduler_steps": self._scheduler_steps,
                  "scaler_updates": self._updates if self.watch.scaler is not None else None,
                  "clip_before_unscale": self._clip_scaled}
        self._scheduler_steps, self._updates, self._clip_scaled = 0, 0, False
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        record.update(meta)
