"""Gradient norms at optimizer-step time, after unscale: total and per layer.

The grads are read as the model's backward left them (agent/loop_watch.py), divided by
the scale they carry: the pre-clip norm, whoever clips and however. The per-parameter
grad norms (one `torch._foreach_norm` in float64) are squared and summed per layer with
one `index_add` straight into the buffer, and in total with one `sum`; the worker takes
the square roots. The total is what `clip_grad_norm_` returns (to float tolerance), inf
or NaN exactly when a grad is. When the loop clips with `clip_grad_norm_` or
`clip_grads_with_norm_`, the clipped norm is derived on the worker the way they scale the
grads: total * min(1, max_norm / (total + 1e-6)); when something else rewrote the grads
before the step (a hand-written clip), their norm is taken again there (one more
`_foreach_norm`, on those steps only). Four device ops a backward; on the CPU
(`watch.host_reduce`) one: the worker sums the norms. Does not synchronise the device.

Underflow, measured: every `sample_every` steps (at most every 10th step) each grad's
non-zero elements are counted (`count_nonzero`, one op per grad) and summed per layer the
same way; the worker turns them into each layer's share of exactly-zero grad elements
(as Megatron-LM counts zeros in the grads). An fp16 gradient that underflowed is zero.

Over several ranks (agent/distributed.py): DTensor grads are read through their local
parts, each weighted so that the server's sum of squares over the ranks is the whole
norm (zero shares are of the rank's own part); under DDP only rank 0 sends the per-layer
values (every rank holds the same grads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ampwatch.agent import distributed
from ampwatch.agent.collectors.base import Collector
from ampwatch.agent.grad_norms import grad_norms
from ampwatch.wire import encode_float_array


def clipped_norm(total: float, max_norm: float) -> float:
    """The norm of the grads after `clip_grad_norm_(max_norm)` scaled them (host)."""
    with np.errstate(all="ignore"):  # inf * 0 is NaN, as on the device
        return float(np.float64(total) * min(1.0, max_norm / (total + 1e-6)))


@dataclass(frozen=True)
class _Indices:
    grad_idx: torch.Tensor | None
    layer_idx: torch.Tensor
    mask: np.ndarray  # layers that have a grad
    elements: np.ndarray  # per layer, its grad elements on this rank
    weight: torch.Tensor | None  # per grad, its weight in the sum over ranks
    total_known: bool


class GradNormCollector(Collector):
    """`grad_norm`, `grad_norm_clipped`, `layer_grad_norm` (null: layer without grads);
    `layer_grad_zero_share` on sampled steps."""

    name = "grads"
    ZERO_EVERY_MIN = 10  # steps between zero counts, at the least

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = 2 * n_layers + 2  # norms, total, non-zero counts, rewritten total
        self._cache: dict[tuple[int, ...], _Indices] = {}
        self._taken = False
        self._blind_named = False
        self._index: _Indices | None = None
        self._max_norm: float | None = None
        # host_reduce: this step's grad norms and the scale they carry
        self._norms: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._rewritten: torch.Tensor | bool | None = None  # host_reduce: the norms, else True
        # sampled steps: elements per layer; host_reduce: the non-zero counts themselves
        self._zeros_of: tuple[np.ndarray, Any] | None = None

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        position = {id(p): i for i, p in enumerate(watch.params)}
        # (parameter position, layer): a tied parameter counts in each layer that holds it
        self._pairs = [(position[id(p)], layer.index)
                       for layer in watch.layers for p in layer.params if id(p) in position]
        self._total_slot = self.view.select(0, self.n_layers)  # 0-d: an out= target
        self._layer_slots = self.view.narrow(0, 0, self.n_layers)
        self._nonzero_slots = self.view.narrow(0, self.n_layers + 1, self.n_layers)
        self._rewritten_slot = self.view.select(0, 2 * self.n_layers + 1)
        self._zeros = torch.zeros(self.n_layers, dtype=watch.buffer.dtype,
                                  device=watch.device)

    def _indices(self, present: tuple[int, ...]) -> _Indices:
        """For this set of params with grads: which grad goes to which layer (the grad
        index is None when it is each grad once, in order), the layers that have one,
        their grad elements, and each grad's weight in the sum over ranks (None: all 1).
        Built once per pattern (the first step pays a small host-to-device copy)."""
        cached = self._cache.get(present)
        if cached is None:
            cached = self._cache[present] = self._build_indices(present)
        return cached

    def _build_indices(self, present: tuple[int, ...]) -> _Indices:
        watch = self.watch
        params = watch.params
        weights = [distributed.shard_weight(params[i], watch.parallelism,
                                            watch.world_size) for i in present]
        # a Partial grad has no norm this rank can take: its layers and the total are left out
        unknown = {present[i] for i, w in enumerate(weights) if w is None}
        rank = {param: i for i, param in enumerate(present)}
        blind = {layer for p, layer in self._pairs if p in unknown}
        pairs = [(rank[p], layer) for p, layer in self._pairs
                 if p in rank and layer not in blind]
        device = watch.device
        grads = [g for g, _ in pairs]
        grad_idx = (None if grads == list(range(len(present))) else
                    torch.tensor(grads, dtype=torch.long, device=device))
        layer_idx = torch.tensor([lay for _, lay in pairs], dtype=torch.long, device=device)
        mask = np.zeros(self.n_layers, dtype=bool)
        mask[[lay for _, lay in pairs]] = True
        elements = np.zeros(self.n_layers)
        for g, lay in pairs:
            elements[lay] += distributed.local(params[present[g]]).numel()
        weight = None
        if any(w != 1.0 for w in weights):
            weight = torch.tensor([0.0 if w is None else w for w in weights],
                                  dtype=watch.buffer.dtype, device=device)
        if unknown and not self._blind_named:
            self._blind_named = True
            watch.note_unsupported("grad_norm", sorted(
                watch.layers[layer].name for layer in blind))
        return _Indices(grad_idx, layer_idx, mask, elements, weight, total_known=not unknown)

    def _counts_zeros(self) -> bool:
        """Every `sample_every` steps, at most every ZERO_EVERY_MIN, in float16 training
        only: underflow is a slow trend, a count reads every grad element (sampling every
        step stays cheap), and bf16 and fp32 grads have float32's range."""
        watch = self.watch
        every = watch.settings.sample_every
        return (every > 0 and watch.step % max(every, self.ZERO_EVERY_MIN) == 0
                and watch.computes_in_fp16)

    def _count_nonzero(self, grads: list[torch.Tensor], grad_idx: torch.Tensor | None,
                       layer_idx: torch.Tensor, elements: np.ndarray) -> None:
        counts = torch.stack([torch.count_nonzero(g) for g in grads])
        if self.watch.host_reduce:
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
        index = self._index = self._indices(present)
        grad_idx, layer_idx = index.grad_idx, index.layer_idx
        if self.watch.parallelism is not None:  # this rank's parts (no communication)
            grads = [distributed.local(g) for g in grads]
        if self._counts_zeros():
            self._count_nonzero(grads, grad_idx, layer_idx, index.elements)
        if norms is None:
            norms = torch.stack(grad_norms(grads))
        if self.watch.host_reduce:  # the worker reduces them (the scale: as it is now)
            self._norms = (norms, None if divisor is None else divisor.detach().clone())
            return
        norms = norms.to(self._zeros.dtype)  # summed in float64: no overflow of the squares
        if divisor is not None:
            norms = norms / divisor
        squares = norms.square()
        if index.weight is not None:
            squares = squares * index.weight
        torch.sum(squares, dim=0, out=self._total_slot)
        if grad_idx is not None:
            squares = squares.index_select(0, grad_idx)
        torch.index_add(self._zeros, 0, layer_idx, squares, out=self._layer_slots)

    def on_grads_rewritten(self, grads: list[torch.Tensor],
                           divisor: torch.Tensor | None) -> None:
        if not self._taken or self.watch.grad_layout == distributed.SHARDED:
            return  # sharded: this rank's part only; the clipped norm needs the whole
        norms = torch.stack(grad_norms(grads)).to(self._zeros.dtype)
        if divisor is not None:
            norms = norms / divisor
        if self.watch.host_reduce:
            self._rewritten = norms
            return
        torch.sum(norms.square(), dim=0, out=self._rewritten_slot)
        self._rewritten = True

    def on_clip_end(self, total_norm: Any, max_norm: float, unscaled: bool) -> None:
        if unscaled and isinstance(total_norm, torch.Tensor) and max_norm is not None:
            self._max_norm = float(max_norm)

    def seal(self) -> Any:
        sealed = (self._index if self._taken else None, self._max_norm, self._norms,
                  self._zeros_of if self._taken else None, self._rewritten)
        self._taken, self._max_norm, self._norms, self._zeros_of = False, None, None, None
        self._index, self._rewritten = None, None
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        n = self.n_layers
        index, max_norm, norms, zeros_of, rewritten = meta
        if zeros_of is not None:
            record["layer_grad_zero_share"] = self._zero_share(host, index.mask, *zeros_of)
        if isinstance(rewritten, torch.Tensor):  # host_reduce
            rewritten = float(np.sqrt(np.square(rewritten.numpy()).sum()))
        elif rewritten:
            rewritten = float(np.sqrt(host[2 * n + 1]))
        if norms is not None:  # host_reduce: the same sums as on_grads, here
            norms, divisor = norms
            values = norms.numpy().astype(np.float64)
            if divisor is not None:
                values = values / divisor.double().numpy()
            squares = np.square(values)
            if index.weight is not None:
                squares = squares * index.weight.numpy()
            host = np.empty(n + 1)
            host[n] = squares.sum()
            if index.grad_idx is not None:
                squares = squares[index.grad_idx.numpy()]
            host[:n] = np.bincount(index.layer_idx.numpy(), weights=squares, minlength=n)
        watch = self.watch
        if index is not None:
            total = float(np.sqrt(host[n])) if index.total_known else None
            record["grad_norm"] = total
            record["layer_grad_norm"] = encode_float_array(np.sqrt(host[:n]), missing=~index.mask)
        else:
            total = None
            record["grad_norm"] = None
            record["layer_grad_norm"] = [None] * n
        if watch.grad_layout == distributed.REPLICATED and watch.rank != 0:
            record["layer_grad_norm"] = None  # DDP: rank 0 sends the one copy
            record.pop("layer_grad_zero_share", None)
        # sharded: this rank's part of the total; the clipped norm needs the whole one
        sharded = watch.grad_layout == distributed.SHARDED
        if rewritten is not None:
            record["grad_norm_clipped"] = rewritten
        else:
            record["grad_norm_clipped"] = (clipped_norm(total, max_norm) if max_norm is not None
                                           and total is not None and not sharded else None)

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
        return encode_float_array(share, missing=~valid)
