"""The step's gradient snapshot: when the grads are read, and whether something rewrote
them before the optimizer stepped. Host counters only; the reads are collectors' device
work (`on_grads`, `on_grads_rewritten`), never a synchronisation."""

from __future__ import annotations

import operator
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

import torch

from ampwatch.agent.grad_norms import grad_norms, kinds

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

_GRAD = operator.attrgetter("grad")


def _same(a: list, b: list) -> bool:
    return a is b or (len(a) == len(b) and all(map(operator.is_, a, b)))


_VERSION = operator.attrgetter("_version")


class GradSnapshot:
    """Taken as each of the model's backwards ends (the last one before the step wins),
    so the grads are as backward left them, before whatever clips or rescales them; taken
    at the step instead when no backward was seen (one the agent cannot observe)."""

    KINDS_KEPT = 64  # patterns of params with a grad whose grads' kinds are kept

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self.taken = False
        # the grads' version counters summed as the snapshot (or an unscale_ or a clip the
        # agent saw) left them: a different sum at the step means something else rewrote them
        self._versions: tuple[tuple[int, ...], list[torch.Tensor], int] | None = None
        # (present, per-parameter norms when they are torch's own, divisor): for a clip
        self._norms: tuple[tuple[int, ...], torch.Tensor | None, Any] = ((), None, None)
        # the loop clips these grads with clip_grad_norm_ (seen on an earlier step): take
        # their norms as it does, for it to reuse; else in float64, exact however large
        self.loop_clips = False
        # per pattern of params with a grad (`present`): what `kinds` says of their grads
        # (a grad's dtype and device hold still: checked once, not every backward)
        self._kinds: dict[tuple[int, ...], tuple[bool, bool]] = {}

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
        norms = shared = None
        if grads and watch.parallelism is None:
            found = self._kinds.get(present)
            if found is None:
                if len(self._kinds) >= self.KINDS_KEPT:  # patterns that keep changing (MoE)
                    self._kinds.clear()
                found = self._kinds[present] = kinds(grads)
            half, uniform = found
            exact = not self.loop_clips
            norms = torch.stack(grad_norms(grads, exact, half))
            # a clip reuses them only where they are torch's own (then bitwise its result)
            shared = norms if uniform and not exact else None
        self._norms = (present, shared, divisor)
        watch.dispatch("on_grads", grads, present, divisor, norms)
        self.note_versions(present)

    def unchanged(self) -> bool:
        """Whether the grads are as the snapshot (or an unscale_ after it) left them."""
        if self._versions is None:
            return False
        _, with_grad, versions = self._versions
        try:
            return sum(map(_VERSION, map(_GRAD, with_grad))) == versions
        except AttributeError:  # a grad dropped since
            return False

    def clip_total(self, arguments: dict[str, Any]) -> torch.Tensor | None:
        """For a `clip_grad_norm_` call (bound arguments) of the grads the snapshot read,
        unchanged since but for `unscale_`: its total norm from the snapshot's norms (no
        second pass over the grads; bitwise torch's), else None. A clip that could reuse
        them but found float64 norms has the next steps take them as torch does."""
        shareable = self._clips_the_snapshot(arguments)
        present, norms, divisor = self._norms
        if not shareable or norms is None:
            self.loop_clips = shareable
            return None
        if divisor is not None:  # read while scaled; unscale_ has divided them since
            norms = norms / divisor
        return torch.linalg.vector_norm(norms, 2.0)

    def _clips_the_snapshot(self, arguments: dict[str, Any]) -> bool:
        """Whether a `clip_grad_norm_` call clips, by the 2-norm, exactly the grads the
        snapshot read, unchanged since but for the scaler's `unscale_`."""
        watch = self.watch
        if (float(arguments["norm_type"]) != 2.0 or arguments["error_if_nonfinite"]
                or watch.parallelism is not None or not self.unchanged()
                or not watch.grads_unscaled() or watch.scaler_enabled and (
                    watch.optimizer is None or watch.split_params.elsewhere(watch.optimizer))):
            return False
        params = arguments["parameters"]
        if not isinstance(params, list):
            return False
        if _same(params, watch.params):
            return True
        ids = {id(p) for p in params if p.grad is not None}
        return ids == {id(watch.params[i]) for i in self._norms[0]}

    def note_versions(self, present: tuple[int, ...] | None = None) -> None:
        """Remember the grads' version counters (host counters: no device work)."""
        if present is None:
            if self._versions is None:
                return
            present, with_grad, _ = self._versions
        else:
            with_grad = list(map(self.watch.params.__getitem__, present))
        try:
            versions = sum(map(_VERSION, map(_GRAD, with_grad)))  # in C: no Python loop
        except AttributeError:  # a grad dropped since: nothing left to compare
            self._versions = None
            return
        self._versions = (present, with_grad, versions)

    def at_step(self, divisor: torch.Tensor | None = None) -> None:
        """At the optimizer step: the snapshot if no backward took it; else, when the grads
        were rewritten since (a clip the agent did not see called, a loop's own scaling),
        their norm as the optimizer gets them is the clipped norm."""
        if not self.taken:
            self.take(divisor)
            return
        if self._versions is None or self.unchanged():
            return
        grads = [self.watch.params[i].grad for i in self._versions[0]]
        if any(g is None for g in grads):  # a grad dropped since
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
