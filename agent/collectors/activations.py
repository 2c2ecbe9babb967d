"""Sampled per-layer forward statistics and the layers' forward execution order.

On a sampled step (every `sample_every` steps, and every step through
`session.anomaly_until`) each layer gets a forward pre/post hook for that step only:
abs-max of its output (one `aminmax` kernel, NaN/inf propagate), the dtype
it computed in, and its forward time. Values are stacked into the buffer at close.
Does not synchronise the device. The first sampled training forward gives the forward
order, and each Linear-like layer's token count (the rows of its GEMM, read from the
input's shape on the host); a change triggers a re-registration of the run's layer table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from agent import guard
from agent.collectors.base import Collector
from agent.layers import dtype_name
from client.wire import encode_array


def first_float_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, list | tuple):
        for item in output:
            found = first_float_tensor(item)
            if found is not None:
                return found
    if isinstance(output, dict):
        return first_float_tensor(list(output.values()))
    return None


def absmax_per_layer(minmax: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
                     n_layers: int, zero: torch.Tensor) -> torch.Tensor:
    """max(|min|, |max|) per layer over its calls; NaN propagates (a few kernels).
    Each value goes to float before the stacks: a stack of mixed dtypes is ~5x slower."""
    lows, highs = [], []
    for i in range(n_layers):
        pairs = minmax.get(i)
        if not pairs:
            lows.append(zero)
            highs.append(zero)
        elif len(pairs) == 1:
            lows.append(pairs[0][0].float())
            highs.append(pairs[0][1].float())
        else:
            lows.append(torch.stack([p[0].float() for p in pairs]).amin())
            highs.append(torch.stack([p[1].float() for p in pairs]).amax())
    return torch.maximum(torch.stack(highs), torch.stack(lows).neg())


class ActivationCollector(Collector):
    """`activations.absmax`, `.dtype`, `.time_ms` on sampled steps."""

    name = "activations"

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = n_layers
        self.order: list[int] = []
        self._hooks: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        self._minmax: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._dtypes: dict[int, str | None] = {}
        self._times: dict[int, list[tuple[Any, Any]]] = {}
        self._starts: dict[int, Any] = {}
        self._seen: list[int] = []
        self._tokens: dict[int, int] = {}

    def bind(self, session: Any) -> None:
        super().bind(session)
        self._zero = torch.zeros((), device=session.device)
        self._layer_hooks = [(layer.module, self._pre(layer.index), self._post(layer.index))
                             for layer in session.layers]  # made once, registered when sampling

    def unbind(self) -> None:
        self._set_sampling(False)

    @property
    def sampling(self) -> bool:
        return bool(self._hooks)

    def on_next_step(self, step: int) -> None:
        settings = self.session.settings
        every = settings.sample_every
        sample = (every > 0 and step % every == 0) or step <= self.session.anomaly_until
        self._set_sampling(sample)

    def on_step_end(self, step: int, stepped: bool) -> None:
        if not stepped:
            self.session.note_anomaly(step)

    def _set_sampling(self, on: bool) -> None:
        if on == self.sampling:
            return
        if not on:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            return
        for module, pre, post in self._layer_hooks:
            self._hooks.append(module.register_forward_pre_hook(pre))
            self._hooks.append(module.register_forward_hook(post))

    # the layer hooks run ~2x per layer per sampled step: the guard is inlined, not a wrapper
    def _pre(self, index: int) -> Any:
        session = self.session
        mark = session.clock.mark
        # a Linear-like layer's GEMM has one row per token: input.numel() / in_features
        in_features = session.layers[index].attrs.get("in_features")
        counts_tokens = isinstance(in_features, int) and in_features > 0

        def hook(module: torch.nn.Module, args: tuple) -> None:
            try:
                if session.in_training_forward:
                    self._starts[index] = mark()
                    if counts_tokens and args and isinstance(args[0], torch.Tensor):
                        self._tokens[index] = args[0].numel() // in_features
            except Exception as exc:  # noqa: BLE001
                guard.report("activations.pre", exc)
        return hook

    def _post(self, index: int) -> Any:
        mark = self.session.clock.mark

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            try:
                start = self._starts.pop(index, None)
                if start is None:
                    return
                self._times.setdefault(index, []).append((start, mark()))
                tensor = first_float_tensor(output)
                if index not in self._dtypes:
                    self._seen.append(index)
                dtype = dtype_name(tensor.dtype) if tensor is not None else None
                previous = self._dtypes.get(index, dtype)
                self._dtypes[index] = dtype if previous == dtype else "mixed"
                if tensor is None or tensor.numel() == 0:
                    return
                self._minmax.setdefault(index, []).append(torch.aminmax(tensor.detach()))
            except Exception as exc:  # noqa: BLE001
                guard.report("activations.post", exc)
        return hook

    def seal(self) -> Any:
        sampled = self.sampling
        sealed = (sampled, self._minmax, self._dtypes, self._times, self._seen, self._tokens)
        self._reset()
        return sealed

    def close(self, sealed: Any) -> Any:
        sampled, minmax, dtypes, times, seen, tokens = sealed
        if not sampled:
            return None
        changed = self._note_tokens(tokens)
        if seen and seen != self.order[: len(seen)] or len(seen) > len(self.order):
            self.order = seen
            for layer in self.session.layers:
                layer.forward_index = seen.index(layer.index) if layer.index in seen else None
            changed = True
        if changed:
            self.session.on_run_change()
        if minmax:
            self.view.copy_(absmax_per_layer(minmax, self.n_layers, self._zero))
        ran = np.array([i in minmax for i in range(self.n_layers)], dtype=bool)
        return {"ran": ran, "dtypes": [dtypes.get(i) for i in range(self.n_layers)],
                "times": [times.get(i) for i in range(self.n_layers)]}

    def _note_tokens(self, tokens: dict[int, int]) -> bool:
        """Put token counts in the layer table: the first seen, replaced only by one that
        is not a multiple of 8 when the kept one is (so a misaligned count is reported
        once rather than re-registering the run for every sequence length)."""
        changed = False
        for index, count in tokens.items():
            attrs = self.session.layers[index].attrs
            kept = attrs.get("token_count")
            if kept is None or (count != kept and count % 8 and not kept % 8):
                attrs["token_count"] = count
                changed = True
        return changed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            return
        clock = self.session.clock
        record["activations"] = {
            "absmax": encode_array(host, missing=~meta["ran"]),
            "dtype": meta["dtypes"],
            "time_ms": [None if t is None else sum(clock.elapsed_ms(a, b) for a, b in t)
                        for t in meta["times"]],
        }
