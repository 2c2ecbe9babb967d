"""A model whose parameters are split across several optimizers sharing one GradScaler
(actor and critic heads, a GAN's generator groups): `scaler.step(first)` unscales the
first optimizer's grads only, so when the watched optimizer steps, the grads of the
parameters another optimizer steps later are still scaled. The agent divides those by
the scale as it reads them (device ops on this case only; no synchronisation), so the
step's grad norm is the whole model's, unscaled.
"""

from __future__ import annotations

from typing import Any

import torch


class SplitParams:
    """Which of the model's parameters (by position in `params`) the watched optimizer
    does not hold, and which of those another optimizer has unscaled this step."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._param_ids = {id(p) for p in params}
        self._elsewhere: frozenset[int] | None = None  # positions; None: not computed yet
        self._overlap: dict[int, frozenset[int]] = {}  # id(other optimizer) -> param ids
        self._unscaled: set[int] = set()  # param ids unscaled by another optimizer

    def elsewhere(self, optimizer: Any) -> frozenset[int]:
        """The positions of the parameters `optimizer` does not hold (once)."""
        if self._elsewhere is None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            self._elsewhere = frozenset(i for i, p in enumerate(self._params)
                                        if id(p) not in held)
        return self._elsewhere

    def unscaled_by(self, optimizer: Any) -> None:
        """Another optimizer's grads were unscaled (`scaler.unscale_`)."""
        overlap = self._overlap.get(id(optimizer))
        if overlap is None:
            overlap = frozenset(id(p) for group in optimizer.param_groups
                                for p in group["params"] if id(p) in self._param_ids)
            self._overlap[id(optimizer)] = overlap
        self._unscaled |= overlap

    def unscale(self, optimizer: Any, present: tuple[int, ...], grads: list[torch.Tensor],
                scale: torch.Tensor) -> list[torch.Tensor]:
        """`grads` (of the params at `present`) with the still scaled ones divided by
        `scale`; `grads` itself when none is."""
        elsewhere = self.elsewhere(optimizer)
        if not elsewhere:
            return grads
        out = grads
        for k, i in enumerate(present):
            if i in elsewhere and id(self._params[i]) not in self._unscaled:
                if out is grads:
                    out = list(grads)
                out[k] = grads[k] / scale
        return out

    def updated(self) -> None:
        """`scaler.update()`: every optimizer's grads are scaled again from here."""
        self._unscaled.clear()
