"""Facts about the model's top-level forwards: time, autocast dtype, train versus eval,
and whether the training input batch held inf/NaN.

The autocast dtype is the one in effect inside the forward: when autocast is off as the
forward begins, a one-shot global module pre-hook reads it at the first submodule call
(accelerate and the HF Trainer enter autocast inside the wrapped `model.forward`). A
forward during which dynamo compiled something is not timed (compiling is not forward
time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ampwatch.agent.collectors.base import Collector
from ampwatch.agent.layers import dtype_name


def _float_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, list | tuple) else (
            value.values() if isinstance(value, dict) else (value,))
        found.extend(t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point())
    return found


class ForwardCollector(Collector):
    """`t_forward_ms`, `autocast_dtype`, `eval_forwards`, `eval_forwards_no_autocast`,
    `input_nonfinite`. The input check is one `aminmax` per floating input tensor
    (inf/NaN propagate into it), reduced on the device at close; no synchronisation."""

    name = "forward"
    slots = 1

    def __init__(self) -> None:
        super().__init__()
        self._current: str | None = None  # autocast dtype of the forward under way
        self._probe: Any = None  # the one-shot global pre-hook looking inside the forward
        self._compiles = 0
        self._reset()

    def _reset(self) -> None:
        self._intervals: list[tuple[Any, Any]] = []
        self._start: Any = None
        self._dtypes: set[str | None] = set()
        self._input_maxes: list[torch.Tensor] = []
        self._training_forwards = 0
        self._eval = 0
        self._eval_no_autocast = 0

    def _autocast(self) -> str | None:
        device_type = self.watch.device_type
        return (dtype_name(torch.get_autocast_dtype(device_type))
                if torch.is_autocast_enabled(device_type) else None)

    def _look_inside(self, module: torch.nn.Module, args: tuple) -> None:
        self._remove_probe()
        self._current = self._autocast()

    def _remove_probe(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        watch = self.watch
        self._current = self._autocast()
        if self._current is None and not watch.compiled:
            self._probe = register_module_forward_pre_hook(self._look_inside)
        if not training:
            return
        self._training_forwards += 1
        for tensor in _float_tensors(args, kwargs):
            if tensor.numel():
                self._input_maxes.extend(torch.aminmax(tensor.detach()))
        self._compiles = watch.compiles.count
        self._start = watch.clock.mark()

    def on_forward_end(self, training: bool, output: Any) -> None:
        self._remove_probe()
        autocast = self._current
        if not training:
            self._eval += 1
            if autocast is None and self.watch.training_autocast is not None:
                self._eval_no_autocast += 1
            return
        if self._start is not None:
            if self.watch.compiles.count == self._compiles:
                self._intervals.append((self._start, self.watch.clock.mark()))
            self._start = None
        self._dtypes.add(autocast)
        if autocast is not None and autocast != self.watch.training_autocast:
            self.watch.training_autocast = autocast
            self.watch.on_run_change()

    def unbind(self) -> None:
        self._remove_probe()

    def seal(self) -> Any:
        dtypes = self._dtypes
        autocast = (None if dtypes <= {None} else
                    next(iter(dtypes)) if len(dtypes) == 1 else "mixed")
        sealed = {"intervals": self._intervals, "autocast": autocast,
                  "training_forwards": self._training_forwards, "eval": self._eval,
                  "eval_no_autocast": self._eval_no_autocast, "inputs": self._input_maxes}
        self._reset()
        return sealed

    def close(self, sealed: Any) -> Any:
        inputs = sealed.pop("inputs")
        sealed["inputs_checked"] = bool(inputs)
        if inputs:
            maxes = torch.stack([t.float() for t in inputs])
            self.view[0].copy_(maxes.isfinite().all().logical_not())
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        clock = self.watch.clock
        record["t_forward_ms"] = (sum(clock.elapsed_ms(a, b) for a, b in meta["intervals"])
                                  if meta["intervals"] else None)
        record["autocast_dtype"] = meta["autocast"]
        record["eval_forwards"] = meta["eval"]
        record["eval_forwards_no_autocast"] = meta["eval_no_autocast"]
        if meta["inputs_checked"]:
            record["input_nonfinite"] = bool(host[0])
        else:
            record["input_nonfinite"] = False if meta["training_forwards"] else None
