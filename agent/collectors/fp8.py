"""Per FP8 layer, on sampled steps: abs-max, scale, RMS, saturated and flushed-to-zero
shares of the input, the weight and the gradient as each is cast to FP8.

Sampled with the activation statistics (every `sample_every` steps and every step of the
anomaly window after a skip, a non-finite value, or an FP8 cast that newly flushed or
saturated more than `FLAG_SHARE` of a tensor). On a sampled step each FP8 layer gets a forward
pre-hook (input and weight, as the layer will cast them) and a forward hook that puts a
tensor hook on the layer's output, whose gradient is what the backward casts. Only the
first training forward of a layer in a step is measured (the first micro-batch under
gradient accumulation). Each tensor costs about eight passes (`fp8.cast_stats`);
nothing synchronises the device: the values reach the step buffer at close and the host
a step later, on the worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ampwatch.agent import errors
from ampwatch.agent.collectors.base import Collector, SampledHooks
from ampwatch.agent.fp8 import N_STATS, ROLES, STATS, Fp8Layer, cast_stats
from ampwatch.wire import encode_float_array


class Fp8Collector(Collector):
    """`fp8.{input,weight,grad}.{amax,scale,rms,saturated,underflow}`, per layer."""

    name = "fp8"
    FLAG_SHARE = 0.01  # a share of saturated or flushed elements that opens the anomaly window

    def __init__(self, fp8_layers: list[Fp8Layer], layers: list[Any]) -> None:
        super().__init__()
        self.fp8_layers = fp8_layers
        self.n_layers = len(layers)
        self.layers = layers
        for layer in fp8_layers:  # the layer table says which layers cast to FP8, and how
            if layer.casting():
                layers[layer.index].attrs.update(layer.attrs())
        self.slots = len(fp8_layers) * len(ROLES) * N_STATS
        self._sampled = False
        self._hooks = SampledHooks(self._register_hooks)  # sampled steps only
        self._stats: dict[tuple[int, int], torch.Tensor] = {}  # (fp8 position, role) -> 5
        self._flagged: set[tuple[int, str, int]] = set()  # worker: the last sample's flags

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._missing = torch.zeros(N_STATS, dtype=torch.float32, device=watch.device)

    def unbind(self) -> None:
        self._hooks.remove()

    @property
    def sampling(self) -> bool:
        return self._sampled

    def on_next_step(self, step: int) -> None:
        sample = self.watch.samples(step)
        if sample != self._sampled:
            self._sampled = sample
            self._hooks.want(sample)

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        self._hooks.ensure()

    def _register_hooks(self) -> list[Any]:
        handles = []
        for position, layer in enumerate(self.fp8_layers):
            handles.append(layer.module.register_forward_pre_hook(self._pre(position)))
            handles.append(layer.module.register_forward_hook(self._post(position)))
        return handles

    def _measure(self, position: int, role: str, tensor: Any) -> None:
        layer = self.fp8_layers[position]
        spec = layer.specs.get(role)
        key = (position, ROLES.index(role))
        if spec is None or key in self._stats or not isinstance(tensor, torch.Tensor):
            return
        scale = layer.scale_of(role)
        if layer.delayed and scale is None:  # never a dynamic scale in a delayed layer's name
            return
        if tensor.is_floating_point() and tensor.numel():
            self._stats[key] = cast_stats(tensor, spec, scale)

    def _casting(self, position: int) -> bool:
        """Whether the layer casts now; a Transformer Engine layer seen casting for the
        first time enters the layer table with its recipe (a re-registration)."""
        layer = self.fp8_layers[position]
        if not layer.casting():
            return False
        attrs = self.layers[layer.index].attrs
        if "fp8_recipe" not in attrs:
            layer.read_recipe()
            attrs.update(layer.attrs())
            self.watch.on_run_change()
        return True

    def _pre(self, position: int) -> Any:
        watch = self.watch

        def hook(module: torch.nn.Module, args: tuple) -> None:
            if torch.compiler.is_compiling():
                return
            try:
                if not watch.in_training_forward or not args or not self._casting(position):
                    return
                x = args[0]
                # Float8Linear casts its input to the autocast dtype first (its forward)
                if isinstance(x, torch.Tensor) and torch.is_autocast_enabled():
                    x = x.to(torch.get_autocast_dtype("cuda"))
                self._measure(position, "input", x)
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    weight = weight.t()  # cast transposed: its per-row scales run along in
                self._measure(position, "weight", weight)
            except Exception as exc:  # noqa: BLE001
                errors.report("fp8.pre", exc)
        return hook

    def _post(self, position: int) -> Any:
        watch = self.watch
        grad_role = ROLES.index("grad")

        def on_grad(grad: torch.Tensor) -> None:
            try:
                self._measure(position, "grad", grad)
            except Exception as exc:  # noqa: BLE001
                errors.report("fp8.grad", exc)

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            try:
                if (watch.in_training_forward and isinstance(output, torch.Tensor)
                        and output.requires_grad and (position, grad_role) not in self._stats
                        and self._casting(position)):
                    output.register_hook(on_grad)
            except Exception as exc:  # noqa: BLE001
                errors.report("fp8.post", exc)
        return hook

    def seal(self) -> Any:
        sealed = (self.sampling, self._stats)
        self._stats = {}
        return sealed

    def close(self, sealed: Any) -> Any:
        sampled, stats = sealed
        if not sampled or not stats:
            return None
        keys = [(p, r) for p in range(len(self.fp8_layers)) for r in range(len(ROLES))]
        self.view.copy_(torch.cat([stats.get(key, self._missing) for key in keys]))
        return frozenset(stats)

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            return
        values = host.reshape(len(self.fp8_layers), len(ROLES), N_STATS)
        out: dict[str, dict[str, list]] = {}
        flagged: set[tuple[int, str, int]] = set()  # (layer, role, stat) over FLAG_SHARE
        for r, role in enumerate(ROLES):
            full = np.zeros((N_STATS, self.n_layers))
            missing = np.ones((N_STATS, self.n_layers), dtype=bool)
            for p, layer in enumerate(self.fp8_layers):
                if (p, r) in meta:
                    full[:, layer.index] = values[p, r]
                    missing[:, layer.index] = False
            if missing.all():
                continue
            for stat in (STATS.index("saturated"), STATS.index("underflow")):
                over = np.flatnonzero(~missing[stat] & (full[stat] > self.FLAG_SHARE))
                flagged.update((int(layer), role, stat) for layer in over)
            out[role] = {name: encode_float_array(full[i], missing=missing[i])
                         for i, name in enumerate(STATS)}
        if out:
            record["fp8"] = out
        # a cast that newly flushes or saturates opens the window; one that stays so
        # does not keep every step sampled for the rest of the run
        if flagged - self._flagged:
            self.watch.note_anomaly(record["step"])
        self._flagged = flagged
