"""The ways of finding the first layer whose output held inf/NaN, one class each behind
one protocol, chosen once as the activations collector is bound (activations.py):

- `EveryOutputOnDevice` (here): one `aminmax` of every output on every step; an
  accelerator with `check_outputs="every_step"`, or where no cheaper way can run;
- `EveryOutputOnHost` (finite_checks.py): the CPU's verdicts of every output, by its sum;
- `ReplaySearch` (forward_search.py): hold the forwards' inputs, replay them when the step
  is known bad (the CPU's loss, an accelerator's GradScaler skip);
- `HeldOutputChecks` (held_outputs.py): an accelerator without a skip to go by: outputs
  held until their backward, checked there by a kernel that reads the loss's flag first.

Each sees an unsampled step only (`output` is never called on a sampled step, whose
outputs the collector's sampled statistics read); they append their findings to the
step's calls, `(layer, dtype, (min, max) or None, start, end)`, which the collector reduces
into the `first_nonfinite_layer` slot at close. Training thread; none synchronises the
device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

# one hooked call: (layer index, output dtype or None, statistics or None, start, end)
Call = tuple[int, torch.dtype | None, Any, Any, Any]

# outputs no reduction reads in their own dtype (aminmax, isfinite, _foreach_norm raise):
# their statistics are taken in float32, which holds every FP8 value
FP8_DTYPES = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the statistics of an output of `dtype`."""
    return torch.float32 if dtype in FP8_DTYPES else dtype


def record_minmax(calls: list[Call], index: int, tensor: torch.Tensor | None,
                  start: Any = None, end: Any = None) -> None:
    """Layer `index`'s call with its output's (min, max) on the device (NaN and inf
    propagate), or without statistics when it has no floating output. An FP8 output is
    read through a float32 copy (rare: FP8 layers give bf16 or float32 outputs)."""
    if tensor is None or not tensor.is_floating_point():
        calls.append((index, None, None, start, end))
    elif tensor.numel() == 0:
        calls.append((index, tensor.dtype, None, start, end))
    else:
        values = tensor.detach()
        if values.dtype in FP8_DTYPES:
            values = values.float()
        calls.append((index, tensor.dtype, torch.aminmax(values), start, end))


class FirstBadLayer:
    """The protocol: what a way does as a forward begins, per output of an unsampled step,
    as backward begins, as the step ends, at seal and at close. No-ops here."""

    # the layers' post hooks stay on between samples (False: on sampled steps only)
    hooks_every_step = True

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch

    def forward_begin(self, sampled: bool, training: bool, args: tuple, kwargs: dict) -> None:
        """A forward of the model begins (`sampled`: this step is sampled)."""

    def output(self, index: int, args: tuple, tensor: torch.Tensor | None,
               preserves_finite: bool, calls: list[Call]) -> None:
        """Layer `index` produced `tensor` (its first floating tensor, or None) in an
        unsampled training forward; `args`: the layer's positional inputs."""

    def forward_end(self) -> None:
        """The forward returned."""

    def backward_begin(self, loss: torch.Tensor | None, calls: list[Call]) -> None:
        """The model's own backward begins with `loss` (unscaled; None when unknown)."""

    def step_end(self, stepped: bool, calls: list[Call]) -> None:
        """The optimizer step ended (`stepped`: False when a GradScaler skipped it)."""

    def seal(self) -> tuple[bool, bool]:
        """The step is sealed: (whether any output was observed, whether a search
        replayed the step: its statistics are host values)."""
        return False, False

    def close(self, first_slot: torch.Tensor) -> None:
        """The sealed step's device values go into the buffer: add to the first-bad slot."""

    def unbind(self) -> None:
        """Drop whatever the way holds (detach)."""


class EveryOutputOnDevice(FirstBadLayer):
    """Every output of every step: one `aminmax` each, reduced at close."""

    def output(self, index: int, args: tuple, tensor: torch.Tensor | None,
               preserves_finite: bool, calls: list[Call]) -> None:
        record_minmax(calls, index, tensor)
