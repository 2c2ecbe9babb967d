"""The loop watch's listeners on the global torch functions it observes (agent/patches.py):
`Tensor.backward`, `zero_grad`, the grad clips, LR schedulers' `step` and torch.compile.
Training thread; host only."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.nn.utils import clip_grad

from ampwatch.agent import errors, patches

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch


class PatchListeners:
    """Registers one loop watch's listeners with the process-wide patches and removes
    them again; each listener turns a call of the loop into the watch's events."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self._backward_ours = False  # the backward under way is the model's own
        self._tokens: list[tuple[patches.GlobalPatch, object]] = []

    def install(self) -> None:
        forward = self.watch.forward
        self._tokens = [
            (patches.BACKWARD, patches.BACKWARD.add(self._backward_before, self._backward_after)),
            (patches.ZERO_GRAD, patches.ZERO_GRAD.add(self._zero_grad_before)),
            (patches.CLIP_GRAD_NORM, patches.CLIP_GRAD_NORM.add(
                self._clip_before, self._clip_after, replace=self._clip_replace)),
            (patches.CLIP_GRADS_WITH_NORM, patches.CLIP_GRADS_WITH_NORM.add(
                self._clip_before, self._clip_after)),
            (patches.SCHEDULER_STEP, patches.SCHEDULER_STEP.add(self._scheduler_before)),
            (patches.COMPILE, patches.COMPILE.add(after=forward.compile_after)),
            (patches.MODULE_COMPILE, patches.MODULE_COMPILE.add(
                after=forward.module_compile_after)),
        ]

    def uninstall(self) -> None:
        for patch, token in self._tokens:
            patch.remove(token)
        self._tokens.clear()

    # Tensor.backward is wrapped for the whole process: only the model's own backward
    # (its graph reaches the model's parameters) is dispatched (agent/attribution.py)
    def _backward_before(self, args: tuple, kwargs: dict) -> None:
        self._backward_ours = False
        watch = self.watch
        if not watch.live:
            return
        self._backward_ours, loss = watch.backward_owner.claim(args[0], watch.scaler_enabled)
        if self._backward_ours:
            watch.dispatch("on_backward_begin", loss)

    def _backward_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        watch = self.watch
        if self._backward_ours and watch.live:
            self._backward_ours = False
            watch.dispatch("on_backward_end")
            watch.take_grads_guarded(watch.scaler._scale if watch.scaler_enabled else None,
                                     again=True)

    def _zero_grad_before(self, args: tuple, kwargs: dict) -> None:
        """The loop drops the model's grads (its optimizer's or the model's `zero_grad`):
        the losses and backwards that made them do not belong to the next step."""
        owner, watch = args[0], self.watch
        if watch.live and (owner is watch.optimizer or owner is watch.model
                           or owner is watch.inner):
            watch.dispatch("on_zero_grad")

    # clip_grad_norm_'s and clip_grads_with_norm_'s arguments arrive bound
    # (patches.CLIP_GRAD_NORM): `parameters` is a list. The snapshot was taken as backward
    # ended; these calls only say whether the loop clipped unscaled grads, and by how much.
    def _clip_before(self, args: tuple, kwargs: dict) -> bool | None:
        """Whether the grads were unscaled; None when the call clips no parameter of this
        model (another model in the process: a discriminator, an EMA copy)."""
        watch = self.watch
        if not watch.live or watch.param_ids.isdisjoint(map(id, kwargs["parameters"])):
            return None
        unscaled = watch.grads_unscaled()
        # no backward seen: the grads before the clip, at least
        if unscaled and not watch.grad_snapshot.taken:
            watch.take_grads_guarded()
        watch.dispatch("on_clip_begin", unscaled)
        return unscaled

    def _clip_replace(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        """`clip_grad_norm_` with the snapshot's norms when they are the clip's (its norm
        pass shared, not repeated); otherwise the original runs."""
        if not self.watch.live:
            return patches.NOT_HANDLED
        try:
            total = self.watch.grad_snapshot.clip_total(kwargs)
        except Exception as exc:  # noqa: BLE001
            errors.report("watch.clip", exc)
            total = None
        if total is None:
            return patches.NOT_HANDLED
        clip_grad._clip_grads_with_norm_(kwargs["parameters"], kwargs["max_norm"], total,
                                         kwargs["foreach"])
        return total

    def _clip_after(self, result: Any, args: tuple, kwargs: dict, unscaled: Any) -> None:
        watch = self.watch
        if unscaled is not None and watch.live:
            watch.grad_snapshot.note_versions()  # a clip seen: its norm is derived, not re-read
            total = kwargs.get("total_norm", result)
            watch.dispatch("on_clip_end", total, kwargs["max_norm"], unscaled)

    def _scheduler_before(self, args: tuple, kwargs: dict) -> None:
        scheduler, watch = args[0], self.watch
        if watch.live and getattr(scheduler, "_step_count", 1) != 0:  # 0: its __init__ step
            watch.dispatch("on_scheduler_step", getattr(scheduler, "optimizer", None))
