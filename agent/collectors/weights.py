"""Each layer's weight norm on sampled steps: `spikes.weight_norm`, the 2-norm of the
parameters the layer owns (a tied parameter counts in the first layer holding it), as the
step's first training forward begins, so it is the weights that step ran with.

One fused `torch._foreach_norm` per device and kind of parameter (float32 accumulation
for float32 and narrower parameters, float64 for float64 ones, whose norm float32 may not
hold), its squares summed into the layers by one `index_add`,
all on the device into the step buffer; the host reads them a step later on the worker.
Nothing synchronises the device. A layer's weights that jump between samples (a bad
update, a loop that rescales them, a corrupted load) show here before anything
downstream overflows: server/analysis/weights.py names that layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent import distributed
from ampwatch.agent.collectors.base import Collector, device_tensor
from ampwatch.wire import encode_float_array


class WeightNormCollector(Collector):
    """`spikes.weight_norm`, per layer, on sampled steps (docs/spikes.md)."""

    name = "weights"

    def __init__(self, layers: list[Any]) -> None:
        super().__init__()
        self.n_layers = len(layers)
        self.slots = self.n_layers
        owned = [(layer.index, p) for layer in layers for p in layer.params
                 if id(p) not in layer.tied]
        self._rows = sorted({index for index, _ in owned})
        self._owned = owned
        self._sampled = False
        self._pending: torch.Tensor | None = None
        self._groups: list[tuple[list[torch.Tensor], torch.dtype, torch.Tensor]] = []

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        local = distributed.local if watch.parallelism is not None else (lambda t: t)
        groups: dict[tuple[torch.device, torch.dtype],
                     tuple[list[torch.Tensor], list[int]]] = {}
        for index, p in self._owned:
            tensor = local(p)
            wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
            params, rows = groups.setdefault((tensor.device, wide), ([], []))
            params.append(tensor)
            rows.append(index)
        # the layer of each parameter, made once: a per-step index would copy host to device
        self._groups = [(params, wide, device_tensor(rows, torch.long, watch.device))
                        for (_, wide), (params, rows) in groups.items()]
        dtype = (torch.float64 if any(wide == torch.float64 for _, wide, _ in self._groups)
                 else torch.float32)
        self._zeros = torch.zeros(self.n_layers, dtype=dtype, device=watch.device)

    def on_next_step(self, step: int) -> None:
        self._sampled = self.watch.samples(step) and bool(self._rows)
        self._pending = None

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        if not (self._sampled and training) or self._pending is not None:
            return
        with torch.no_grad():
            squares = self._zeros
            for params, wide, rows in self._groups:
                norms = torch._foreach_norm(params, 2, dtype=wide)
                sq = torch.stack(norms).to(self._zeros.device, self._zeros.dtype,
                                           non_blocking=True).square()
                squares = squares.index_add(0, rows, sq)
            self._pending = squares.sqrt()

    def seal(self) -> Any:
        pending, self._pending = self._pending, None
        return pending

    def close(self, sealed: Any) -> Any:
        if sealed is None:
            return None
        self.view.copy_(sealed.to(self.view.dtype))
        return True

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            return
        missing = np.ones(self.n_layers, dtype=bool)
        missing[self._rows] = False
        values = np.where(missing, 0.0, host[: self.n_layers].astype(np.float64))
        record.setdefault("spikes", {})["weight_norm"] = encode_float_array(values, missing)
