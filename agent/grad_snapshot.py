"""The step's gradient snapshot: when the grads are read, and whether something rewrote
them before the optimizer stepped. Host counters only; the reads are collectors' device
work (`on_grads`, `on_grads_rewritten`), never a synchronisation."""

from __future__ import annotations

import operator
from itertools import compress, repeat
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


class GradSnapshot:
    """Taken as each of the model's backwards ends (the last one before the step wins),
    so the grads are as backward left them, before whatever clips or rescales them; taken
    at the step instead when no backward was seen (one the agent cannot observe)."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self.taken = False
        # the grads' version counters summed as the snapshot (or an unscale_ or a clip the
        # agent saw) left them: a different sum at the step means something else rewrote them
        self._versions: tuple[tuple[int, ...], int] | None = None

    def step_ended(self) -> None:
        self.taken = False
        self._versions = None

    def take(self, divisor: torch.Tensor | None = None, again: bool = False) -> None:
        """Dispatch `on_grads` with the grads now (`again`: even when taken this step).
        `divisor`: the scale the grads still carry (GradScaler's, on device)."""
        if self.taken and not again:
            return
        self.taken = True
        watch = self.watch
        watch.close_pending()
        present = self.present()
        grads = [watch.params[i].grad for i in present]
        if divisor is None and watch.scaler_enabled and watch.optimizer is not None:
            grads = watch.split_params.unscale(watch.optimizer, present, grads,
                                               watch.scaler._scale)
        watch.dispatch("on_grads", grads, present, divisor)
        self.note_versions(present)

    def note_versions(self, present: tuple[int, ...] | None = None) -> None:
        """Remember the grads' version counters (host counters: no device work)."""
        if present is None:
            if self._versions is None:
                return
            present = self._versions[0]
        params = self.watch.params
        try:
            versions = sum(map(_VERSION, (params[i].grad for i in present)))
        except AttributeError:  # a grad dropped since: nothing left to compare
            self._versions = None
            return
        self._versions = (present, versions)

    def at_step(self, divisor: torch.Tensor | None = None) -> None:
        """At the optimizer step: the snapshot if no backward took it; else, when the grads
        were rewritten since (a clip the agent did not see called, a loop's own scaling),
        their norm as the optimizer gets them is the clipped norm."""
        if not self.taken:
            self.take(divisor)
            return
        if self._versions is None:
            return
        present, versions = self._versions
        params = self.watch.params
        try:
            grads = [params[i].grad for i in present]
            if sum(map(_VERSION, grads)) == versions:
                return
        except AttributeError:  # a grad dropped since
            return
        self._versions = None
        watch = self.watch
        if divisor is None and not watch.grads_unscaled():
            divisor = watch.scaler._scale
        watch.dispatch("on_grads_rewritten", grads, divisor)

    def present(self) -> tuple[int, ...]:
        """The positions of the params that have a grad (iterated in C: once per step)."""
        params = self.watch.params
        return tuple(compress(range(len(params)),
                              map(operator.is_not, map(_GRAD, params), repeat(None))))
