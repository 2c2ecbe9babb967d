"""Gradient norms at optimizer-step time, after unscale: total and per layer.

The per-parameter grad norms (one `torch._foreach_norm`, or the ones `clip_grad_norm_`
already took) are squared in float64 and summed per layer with one `index_add` straight
into the buffer, and in total with one `sum`; the worker takes the square roots. The total
is what `clip_grad_norm_` returns (to float tolerance), inf or NaN exactly when a grad
is. When the loop clips the unscaled grads, the clipped norm is derived on the worker the
way `clip_grad_norm_` scales the grads: total * min(1, max_norm / (total + 1e-6)).
Four device ops a step; on the CPU (`session.host_reduce`) none: the worker sums the
norms. Does not synchronise the device.

Underflow, measured: on sampled steps (those whose activations are sampled) each grad's
non-zero elements are counted (`count_nonzero`, one op per grad) and summed per layer the
same way; the worker turns them into each layer's share of exactly-zero grad elements
(as Megatron-LM counts zeros in the grads). An fp16 gradient that underflowed is zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent.collectors.base import Collector
from ampwatch.client.wire import encode_array


def clipped_norm(total: float, max_norm: float) -> float:
    """The norm of the grads after `clip_grad_norm_(max_norm)` scaled them (host)."""
    with np.errstate(all="ignore"):  # inf * 0 is NaN, as on the device
        return float(np.float64(total) * min(1.0, max_norm / (total + 1e-6)))


class GradNormCollector(Collector):
    """`grad_norm`, `grad_norm_clipped`, `layer_grad_norm` (null: layer without grads);
    `layer_grad_zero_share` on sampled steps."""

    name = "grads"

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = 2 * n_layers + 1  # norms, total, non-zero counts
        self._cache: dict[tuple[int, ...], tuple[Any, torch.Tensor, np.ndarray,
                                                 np.ndarray]] = {}
        self._taken = False
        self._max_norm: float | None = None
        # host_reduce: this step's grad norms with their grad and layer indices
        self._norms: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        # sampled steps: elements per layer; host_reduce: the non-zero counts themselves
        self._zeros_of: tuple[np.ndarray, Any] | None = None

    def bind(self, session: Any) -> None:
        super().bind(session)
        position = {id(p): i for i, p in enumerate(session.params)}
        # (parameter position, layer): a tied parameter counts in each layer that holds it
        self._pairs = [(position[id(p)], layer.index)
                       for layer in session.layers for p in layer.params if id(p) in position]
        self._total_slot = self.view.select(0, self.n_layers)  # 0-d: an out= target
        self._layer_slots = self.view.narrow(0, 0, self.n_layers)
        self._nonzero_slots = self.view.narrow(0, self.n_layers + 1, self.n_layers)
        self._zeros = torch.zeros(self.n_layers, dtype=session.buffer.dtype,
                                  device=session.device)

    def _indices(self, present: tuple[int, ...]
                 ) -> tuple[torch.Tensor | None, torch.Tensor, np.ndarray, np.ndarray]:
        """For this set of params with grads: which grad goes to which layer (the grad
        index is None when it is each grad once, in order), the layers that have one and
        their grad elements. Built once per pattern (the first step pays a small
        host-to-device copy)."""
        cached = self._cache.get(present)
        if cached is None:
            rank = {param: i for i, param in enumerate(present)}
            pairs = [(rank[p], layer) for p, layer in self._pairs if p in rank]
            device = self.session.device
            grads = [p for p, _ in pairs]
            grad_idx = (None if grads == list(range(len(present))) else
                        torch.tensor(grads, dtype=torch.long, device=device))
            layer_idx = torch.tensor([lay for _, lay in pairs], dtype=torch.long, device=device)
            mask = np.zeros(self.n_layers, dtype=bool)
            mask[[lay for _, lay in pairs]] = True
            params = self.session.params
            elements = np.zeros(self.n_layers)
            for p, lay in pairs:
                elements[lay] += params[present[p]].numel()
            cached = self._cache[present] = (grad_idx, layer_idx, mask, elements)
        return cached

    def _sampled(self) -> bool:
        session = self.session
        every = session.settings.sample_every
        return (every > 0 and session.step % every == 0) or session.step <= session.anomaly_until

    def _count_nonzero(self, grads: list[torch.Tensor], grad_idx: torch.Tensor | None,
                       layer_idx: torch.Tensor, elements: np.ndarray) -> None:
        counts = torch.stack([torch.count_nonzero(g) for g in grads])
        if self.session.host_reduce:
            self._zeros_of = (elements, (counts, grad_idx, layer_idx))
            return
        counts = counts.to(self._zeros.dtype)
        if grad_idx is not None:
            counts = counts.index_select(0, grad_idx)
        torch.index_add(self._zeros, 0, layer_idx, counts, out=self._nonzero_slots)
        self._zeros_of = (elements, None)

    def on_grads(self, grads: list[torch.Tensor], present: tuple[int, ...],
                 divisor: torch.Tensor | None, norms: torch.Tensor | None) -> None:
        self._taken = bool(grads)
        if not grads:
            return
        grad_idx, layer_idx, self._mask, elements = self._indices(present)
        if self._sampled():
            self._count_nonzero(grads, grad_idx, layer_idx, elements)
        if norms is None:
            norms = torch.stack(torch._foreach_norm(grads))
        if self.session.host_reduce and divisor is None:
            self._norms = (norms, grad_idx, layer_idx)  # the worker reduces them
            return
        squares = norms.to(self._zeros.dtype)
        if divisor is not None:
            squares = squares / divisor
        squares = squares.square()
        torch.sum(squares, dim=0, out=self._total_slot)
        if grad_idx is not None:
            squares = squares.index_select(0, grad_idx)
        torch.index_add(self._zeros, 0, layer_idx, squares, out=self._layer_slots)

    def on_clip_end(self, total_norm: Any, max_norm: float, unscaled: bool) -> None:
        if unscaled and isinstance(total_norm, torch.Tensor) and max_norm is not None:
            self._max_norm = float(max_norm)

    def seal(self) -> Any:
        sealed = (self._mask if self._taken else None, self._max_norm, self._norms,
                  self._zeros_of if self._taken else None)
        self._taken, self._max_norm, self._norms, self._zeros_of = False, None, None, None
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        n = self.n_layers
        mask, max_norm, norms, zeros_of = meta
        if zeros_of is not None:
            record["layer_grad_zero_share"] = self._zero_share(host, mask, *zeros_of)
        if norms is not None:  # host_reduce: the same sums as on_grads, here
            norms, grad_idx, layer_idx = norms
            squares = np.square(norms.numpy().astype(np.float64))
            host = np.empty(n + 1)
            host[n] = squares.sum()
            if grad_idx is not None:
                squares = squares[grad_idx.numpy()]
            host[:n] = np.bincount(layer_idx.numpy(), weights=squares, minlength=n)
        if mask is not None:
            total = float(np.sqrt(host[n]))
            record["grad_norm"] = total
            record["layer_grad_norm"] = encode_array(np.sqrt(host[:n]), missing=~mask)
        else:
            total = None
            record["grad_norm"] = None
            record["layer_grad_norm"] = [None] * n
        record["grad_norm_clipped"] = (clipped_norm(total, max_norm)
                                       if max_norm is not None and total is not None else None)

    def _zero_share(self, host: np.ndarray, mask: np.ndarray, elements: np.ndarray,
                    counts: Any) -> list:
        """Per layer, the share of its grad elements that are exactly zero (worker)."""
        n = self.n_layers
        if counts is None:
            nonzero = host[n + 1: 2 * n + 1]
        else:  # host_reduce: sum the counts per layer here
            counts, grad_idx, layer_idx = counts
            values = counts.numpy().astype(np.float64)
            if grad_idx is not None:
                values = values[grad_idx.numpy()]
            nonzero = np.bincount(layer_idx.numpy(), weights=values, minlength=n)
        valid = mask & (elements > 0)
        share = 1.0 - np.divide(nonzero, elements, out=np.ones(n), where=valid)
        return encode_array(share, missing=~valid)
