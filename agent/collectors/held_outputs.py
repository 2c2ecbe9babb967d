"""Layer outputs held (references, no device op) for one check later in the step: until
their backward begins for the flagged kernel (`HeldOutputChecks`, one way of
first_bad_layer.py), or to a sampled forward's end for its abs-max in one
`_foreach_norm` per dtype (activations.py). Within a budget for what only the agent keeps
alive (flagged_checks.py says why), counted from the first held step on; past it, for an
output changed in place before its check, and for one on another device than the model's
accelerator, the call takes its own `aminmax` as it is produced."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampwatch.agent import errors
from ampwatch.agent.collectors import flagged_checks
from ampwatch.agent.collectors.first_bad_layer import (
    FP8_DTYPES,
    Call,
    FirstBadLayer,
    record_minmax,
)

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch


class HeldOutputs:
    """The outputs held since the last check, and what past checks said of each layer."""

    def __init__(self, budget: int, device: torch.device) -> None:
        self.budget = budget  # bytes that outputs only the agent keeps alive may hold
        self.device = device  # the model's: an output elsewhere is never held
        self.outputs: list[tuple[int, int, torch.Tensor, int]] = []  # (call, layer, output,
        # its version when produced)
        self._in_place: set[int] = set()  # layers whose output changed before its check
        self._kept: set[int] = set()  # layers whose held output autograd kept alive too
        self.held_bytes = 0  # what outputs counted against the budget hold since the check
        self._watched: dict[int, Any] = {}  # layer: weak reference to an unheld output's
        # storage, for layers not judged yet (whether autograd keeps it alive)

    def hold(self, index: int, tensor: torch.Tensor, calls: list[Call], start: object = None,
             end: object = None, kernel: bool = False) -> bool:
        """Hold layer `index`'s output and add its call (no statistics yet); False when it
        cannot be held (`kernel`: the flagged kernel must be able to read it: a dense
        layout, channels_last included; an FP8 output, which no fused reduction reads, never
        is)."""
        if (index in self._in_place or not tensor.is_floating_point() or not tensor.numel()
                or tensor.device != self.device or tensor.dtype in FP8_DTYPES
                or (kernel and not (flagged_checks.dense(tensor)
                                    and flagged_checks.readable(tensor.dtype)))):
            return False
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor: no version counter
            return False
        if not self._within_budget(index, tensor):
            self._watch(index, tensor)
            return False
        self.outputs.append((len(calls), index, tensor, version))
        calls.append((index, tensor.dtype, None, start, end))
        return True

    def _within_budget(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether holding `tensor` (layer `index`'s output) stays within the budget: an
        output autograd kept anyway (at the last check) costs nothing; any other, one not
        judged yet included (the first held step), counts its bytes."""
        if index in self._kept:
            return True
        size = tensor.numel() * tensor.element_size()
        if self.held_bytes + size > self.budget:
            return False
        self.held_bytes += size
        return True

    def _watch(self, index: int, tensor: torch.Tensor) -> None:
        """An output not judged yet that did not fit: a weak reference to its storage
        (host only, keeps nothing alive) tells at the check whether autograd kept it."""
        if index in self._kept or index in self._watched:
            return
        weak = flagged_checks.storage_weak_ref(tensor)
        if weak is not None:
            self._watched[index] = weak

    def take(self) -> list[tuple[int, torch.Tensor]]:
        """The held outputs as (call position, output), released, and what each says of
        its layer: changed in place since it was produced (from the next step on checked
        as produced; this one as it is now), and whether only the agent kept it alive
        (then held within the budget only; else held free); and, of the outputs not held
        for want of budget before their layer was judged, whether their storage is still
        alive (autograd kept it: held free from now on)."""
        held, self.outputs = self.outputs, []
        self.held_bytes = 0
        for _, index, output, version in held:
            if output._version != version:
                self._in_place.add(index)
            if flagged_checks.kept_alone(output):
                self._kept.discard(index)
            else:
                self._kept.add(index)
        watched, self._watched = self._watched, {}
        for index, weak in watched.items():
            if not weak.expired():  # its storage outlived the agent's not holding it
                self._kept.add(index)
        return [(position, output) for position, _, output, _ in held]

    def clear(self) -> None:
        self.outputs = []
        self.held_bytes = 0
        self._watched = {}


class HeldOutputChecks(FirstBadLayer):
    """An accelerator without a GradScaler's skip to go by: each unsampled training
    forward's outputs are held until its backward begins, then checked by the flagged
    kernel, which reads the loss's flag first (a healthy step reads no output). An output
    that cannot be held gets its own `aminmax`. A kernel that fails to launch (a Triton
    that cannot compile for this GPU, no C compiler to build its launcher) is reported
    once; that step's held outputs are reported unchecked (never finite), and from its
    close on `failed()` moves the collector to checking every output."""

    def __init__(self, watch: LoopWatch, held: HeldOutputs, checks: flagged_checks.FlaggedChecks,
                 failed: Callable[[], None]) -> None:
        super().__init__(watch)
        self.held = held
        self.checks = checks
        self.failed = failed
        self._holding = False  # this forward records a graph (a backward follows)
        self._broken = False  # a launch failed: nothing is held any more

    def forward_begin(self, sampled: bool, training: bool, args: tuple, kwargs: dict) -> None:
        # under no_grad no backward follows, and holding would keep alive outputs the
        # forward frees as it goes: those are checked as produced
        self._holding = not sampled and torch.is_grad_enabled() and not self._broken

    def output(self, index: int, args: tuple, tensor: torch.Tensor | None,
               preserves_finite: bool, calls: list[Call]) -> None:
        if not (self._holding and tensor is not None
                and self.held.hold(index, tensor, calls, kernel=True)):
            record_minmax(calls, index, tensor)

    def backward_begin(self, loss: torch.Tensor | None, calls: list[Call]) -> None:
        if self.held.outputs:
            self._check(loss)
        else:
            self.held.take()  # judges the outputs watched instead of held

    def _check(self, loss: torch.Tensor | None) -> None:
        """Launch the flagged check of each output held since the last backward (no read:
        a healthy step's kernels read the flag and exit)."""
        checks = self.checks
        try:
            checks.check(checks.flag(loss), self.held.take())
        except Exception as exc:  # noqa: BLE001 (a Triton that cannot compile for this GPU)
            self._holding, self._broken = False, True
            checks.lost()
            errors.report("activations.flagged_checks", exc)

    def seal(self) -> tuple[bool, bool]:
        # outputs of a forward no backward followed: checked as if its loss were bad (they
        # are read; a rare case)
        if self.held.outputs:
            self._check(None)
        return False, False

    def close(self, first_slot: torch.Tensor) -> None:
        self.checks.take_into(first_slot)
        if self._broken:
            self.failed()  # from the next step on every output is checked as made
