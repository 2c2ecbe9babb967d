"""Between samples on the CPU: whether each layer output held inf/NaN, on every step
(`EveryOutputOnHost`, one way of first_bad_layer.py).

Each output is checked by its sum, read at once (2-5x cheaper than `aminmax`; an inf/NaN
sum is confirmed by `aminmax`, since finite values can overflow a sum), in the hook, while
the output is unchanged and still in the cache. Two kinds of output need no sum, exactly:
the output just checked, unchanged (a block returning its last layer's), takes that
verdict; an elementwise finite-preserving layer (`FINITE_PRESERVING`) applied to the
output just found finite, unchanged, is finite.

Reads values of host tensors only: nothing here waits for a device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampwatch.agent.collectors.first_bad_layer import Call, FirstBadLayer, record_minmax

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

# fp16 sums overflow too often to gain (aminmax is used for float16 outputs)
SUM_CHECKED = frozenset({torch.bfloat16, torch.float32})
FINITE = (0.0, 0.0)

# Elementwise functions that map finite inputs to finite outputs (|f(x)| <= |x| or
# bounded), exact types only (a subclass may override forward): such a layer whose input
# is the output just checked finite needs no check of its own (the MLP activation after
# its Linear, the largest output of a transformer block)
FINITE_PRESERVING = frozenset({nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh,
                               nn.Sigmoid, nn.Hardtanh, nn.Softmax})


def first_float_tensor(output: Any) -> torch.Tensor | None:
    """The first floating tensor of a module's output (a tensor, or nested in a tuple,
    list or dict)."""
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


def finite_check(tensor: torch.Tensor) -> tuple[float, float]:
    """Host tensors only (reads a value): FINITE when the sum is finite, which needs every
    element finite; otherwise the exact (min, max), since a sum of finite values can
    overflow."""
    if math.isfinite(tensor.sum().item()):
        return FINITE
    low, high = torch.aminmax(tensor)
    return low.item(), high.item()


def first_nonfinite_call(calls: list[Call]) -> int | None:
    """Host: the position of the first call whose (min, max) is not finite (worker)."""
    for position, call in enumerate(calls):
        stats = call[2]
        if stats is not None and stats is not FINITE and not (
                math.isfinite(float(stats[0])) and math.isfinite(float(stats[1]))):
            return position
    return None


class HostChecks:
    """The verdicts of one step's unsampled training forwards on the CPU (training thread).

    `check()` takes each hooked output in execution order and appends a call to `calls`
    only for one that held inf/NaN, so the first such call is the first offender.
    """

    def __init__(self) -> None:
        self.observed = False  # an output was checked since the collector last took this
        # the last checked output, its version and verdict (attributes, not a tuple: the
        # hot path allocates as little as it can, every allocation brings the GC nearer)
        self.seen: torch.Tensor | None = None
        self.seen_version = 0
        self.seen_stats: tuple[float, float] = FINITE

    def check(self, index: int, args: tuple, tensor: torch.Tensor, version: int,
              dtype: torch.dtype, preserves_finite: bool, calls: list[Call]) -> None:
        """The verdict on layer `index`'s output `tensor` (at `version`; `args`: the
        layer's positional inputs; `preserves_finite`: the layer is FINITE_PRESERVING)."""
        self.observed = True
        seen = self.seen
        if seen is not None and seen._version == self.seen_version and (
                tensor is seen or (preserves_finite and args and args[0] is seen
                                   and self.seen_stats is FINITE)):
            stats = self.seen_stats
        else:
            stats = finite_check(tensor.detach())
        self.seen, self.seen_version, self.seen_stats = tensor, version, stats
        if stats is not FINITE:
            calls.append((index, dtype, stats, None, None))

    def end_forward(self) -> None:
        """At the end of each training forward: no output is kept alive through backward."""
        self.seen = None


class EveryOutputOnHost(FirstBadLayer):
    """The CPU's way when no replay can serve (`check_outputs="every_step"`, several
    ranks): every unsampled output is judged on the host as it is produced (`HostChecks`);
    one whose dtype or tensor the sum cannot judge gets an `aminmax` call instead."""

    def __init__(self, watch: LoopWatch) -> None:
        super().__init__(watch)
        self.host = HostChecks()

    def output(self, index: int, args: tuple, tensor: torch.Tensor | None,
               preserves_finite: bool, calls: list[Call]) -> None:
        if tensor is not None:
            dtype = tensor.dtype  # SUM_CHECKED holds floating dtypes only
            # finite_check reads a value: CPU tensors only, so no device to wait for
            if dtype in SUM_CHECKED and tensor.is_cpu:
                try:
                    version = tensor._version
                except RuntimeError:  # an inference tensor: no version counter
                    version = None
                if version is not None:
                    self.host.check(index, args, tensor, version, dtype, preserves_finite,
                                    calls)
                    return
        record_minmax(calls, index, tensor)

    def forward_end(self) -> None:
        self.host.end_forward()

    def seal(self) -> tuple[bool, bool]:
        host = self.host
        host.end_forward()
        observed, host.observed = host.observed, False
        return observed, False
