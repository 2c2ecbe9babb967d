"""The loop watch's wrappers of a GradScaler's `scale`, `unscale_`, `step` and `update`.

GradScaler has no hooks: each method is wrapped on the instance (its `__dict__`), so two
attachments may share a scaler and be detached in either order. Training thread; the
wrappers add host work only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ampwatch.agent import errors

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

METHODS = ("scale", "unscale_", "step", "update")


def _unwrap(scaler: Any, name: str, wrapper: Callable) -> None:
    """Put back what `wrapper` wrapped, skipping the wrappers of attachments detached
    since (two runs sharing one scaler, detached in either order)."""
    previous = wrapper.__ampwatch_previous__  # type: ignore[attr-defined]
    while previous is not None and getattr(previous, "__ampwatch_watch__", None) is not None \
            and not previous.__ampwatch_watch__.active:
        previous = previous.__ampwatch_previous__
    if previous is None:
        scaler.__dict__.pop(name, None)
    else:
        setattr(scaler, name, previous)


class ScalerWrappers:
    """Turns the scaler's calls into the watch's step events. `in_step`: inside our
    `scaler.step` (the optimizer hooks then leave the step to it); `opt_stepped`: the
    optimizer's step ran inside it (else the scaler skipped it)."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self.in_step = False
        self.opt_stepped = False
        self._wrapped: list[tuple[str, Callable]] = []  # (method, our wrapper)

    def install(self) -> None:
        scaler = self.watch.scaler
        if scaler is None:
            return
        for name in METHODS:
            wrapper = getattr(self, f"_wrap_{name.rstrip('_')}")(getattr(scaler, name))
            wrapper.__ampwatch_previous__ = scaler.__dict__.get(name)  # type: ignore[attr-defined]
            wrapper.__ampwatch_watch__ = self.watch  # type: ignore[attr-defined]
            setattr(scaler, name, wrapper)
            self._wrapped.append((name, wrapper))

    def uninstall(self) -> None:
        scaler = self.watch.scaler
        for name, wrapper in self._wrapped:
            if scaler.__dict__.get(name) is wrapper:
                _unwrap(scaler, name, wrapper)
            # else another attachment sharing the scaler wrapped ours: ours stays in its
            # chain, passing calls through, until that one is detached
        self._wrapped.clear()

    def _wrap_scale(self, original: Callable) -> Callable:
        watch = self.watch

        def scale(outputs: Any) -> Any:
            if not watch.live:
                return original(outputs)
            watch.dispatch("on_scale", outputs)
            scaled = original(outputs)
            try:
                watch.backward_owner.scaled.note(outputs, scaled)
            except Exception as exc:  # noqa: BLE001
                errors.report("watch.scale", exc)
            return scaled
        return scale

    def _wrap_unscale(self, original: Callable) -> Callable:
        watch = self.watch

        def unscale_(optimizer: Any) -> None:
            original(optimizer)
            if watch.live:
                try:
                    if not watch.adopt(optimizer):
                        watch.split_params.unscaled_by(optimizer)
                    elif self.in_step:
                        watch.grad_snapshot.take()  # no backward seen: the grads are final now
                    watch.grad_snapshot.note_versions()  # unscaling rewrote them, as expected
                except Exception as exc:  # noqa: BLE001
                    errors.report("watch.unscale_", exc)
        return unscale_

    def _wrap_step(self, original: Callable) -> Callable:
        watch = self.watch

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                ours = watch.live and watch.adopt(optimizer)
                if ours:
                    watch.step_begin()
                    if watch.grads_unscaled():
                        watch.grad_snapshot.at_step()
                    elif getattr(optimizer, "_step_supports_amp_scaling", False):
                        # fused: the grads stay scaled
                        watch.grad_snapshot.at_step(divisor=watch.scaler._scale)
            except Exception as exc:  # noqa: BLE001
                errors.report("watch.step", exc)
                ours = False
            if not ours:
                return original(optimizer, *args, **kwargs)
            self.in_step, self.opt_stepped = True, False
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self.in_step = False
                watch.step_end_guarded(self.opt_stepped)
        return step

    def _wrap_update(self, original: Callable) -> Callable:
        watch = self.watch

        def update(new_scale: Any = None) -> None:
            if watch.live:
                watch.dispatch("on_update_begin")
            original(new_scale)
            watch.split_params.updated()
            if watch.live:
                closing = watch.has_pending
                watch.dispatch("on_update_end", closing)
                if closing:
                    watch.close_pending()
        return update
