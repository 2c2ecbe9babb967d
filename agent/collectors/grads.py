"""Gradient norms at optimizer-step time, after unscale: total and per layer.

One `torch._foreach_norm` over the grads present, squared and summed per layer with one
`index_add_` into a preallocated vector; the total is the square root of the sum over
unique parameters, which is what `clip_grad_norm_` returns (to float tolerance), inf or
NaN exactly when a grad is. Does not synchronise the device. When the loop clips the
unscaled grads, the clipped norm is derived on the device from `clip_grad_norm_`'s own
result the way it scales the grads: total * min(1, max_norm / (total + 1e-6)).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from agent.collectors.base import Collector
from client.wire import encode_array


class GradNormCollector(Collector):
    """`grad_norm`, `grad_norm_clipped`, `layer_grad_norm` (null: layer without grads)."""

    name = "grads"

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = n_layers + 2
        self._cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
        self._taken = False
        self._clip: tuple[torch.Tensor, float] | None = None

    def bind(self, session: Any) -> None:
        super().bind(session)
        position = {id(p): i for i, p in enumerate(session.params)}
        self._pairs = [(position[id(p)], layer.index)
                       for layer in session.layers for p in layer.params if id(p) in position]
        self._total_slot = self.view.select(0, self.n_layers)  # 0-d: an out= target
        self._clipped_slot = self.slot(self.n_layers + 1)
        self._layer_slots = self.view.narrow(0, 0, self.n_layers)
        self._layer_sq = torch.zeros(self.n_layers, dtype=session.buffer.dtype,
                                     device=session.device)

    def _indices(self, present: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Index tensors for this set of params with grads; built once per pattern (the
        first step pays one small host-to-device copy)."""
        cached = self._cache.get(present)
        if cached is None:
            rank = {param: i for i, param in enumerate(present)}
            pairs = [(rank[p], layer) for p, layer in self._pairs if p in rank]
            device = self.session.device
            grad_idx = torch.tensor([p for p, _ in pairs], dtype=torch.long, device=device)
            layer_idx = torch.tensor([lay for _, lay in pairs], dtype=torch.long, device=device)
            mask = np.zeros(self.n_layers, dtype=bool)
            mask[[lay for _, lay in pairs]] = True
            cached = self._cache[present] = (grad_idx, layer_idx, mask)
        return cached

    def on_grads(self, grads: list[torch.Tensor], present: tuple[int, ...],
                 divisor: torch.Tensor | None, norms: list[torch.Tensor] | None) -> None:
        self._taken = bool(grads)
        if not grads:
            return
        grad_idx, layer_idx, self._mask = self._indices(present)
        if norms is None:
            norms = list(torch._foreach_norm(grads))
        norms = torch.stack(norms).to(self._layer_sq.dtype)
        if divisor is not None:
            norms = norms / divisor
        squares = norms.square()
        torch.sqrt(squares.sum(), out=self._total_slot)
        self._layer_sq.zero_().index_add_(0, layer_idx, squares.index_select(0, grad_idx))
        torch.sqrt(self._layer_sq, out=self._layer_slots)

    def on_clip_end(self, total_norm: Any, max_norm: float, unscaled: bool) -> None:
        if unscaled and isinstance(total_norm, torch.Tensor) and max_norm is not None:
            self._clip = (total_norm, float(max_norm))

    def seal(self) -> Any:
        sealed = (self._taken, self._mask if self._taken else None, self._clip)
        self._taken, self._clip = False, None
        return sealed

    def close(self, sealed: Any) -> Any:
        taken, mask, clip = sealed
        if clip is not None:
            total, max_norm = clip
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._clipped_slot.copy_(total * coef)
        return {"taken": taken, "mask": mask, "clipped": clip is not None}

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        n = self.n_layers
        if meta["taken"]:
            record["grad_norm"] = float(host[n])
            record["layer_grad_norm"] = encode_array(host[:n], missing=~meta["mask"])
        else:
            record["grad_norm"] = None
            record["layer_grad_norm"] = [None] * n
        record["grad_norm_clipped"] = float(host[n + 1]) if meta["clipped"] else None
