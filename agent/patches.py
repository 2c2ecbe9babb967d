"""Shared wrappers around global torch functions the agent must observe.

`clip_grad_norm_`, `clip_grads_with_norm_`, `Tensor.backward`, `zero_grad` (of optimizers
and modules), LR schedulers' `step`, `torch.compile` and `Module.compile` have no hook API,
so one wrapper per function is installed while at least one listener is registered and
removed with the last one. Listeners run inside the error boundary (errors.py); the wrapped
call itself is untouched (its exceptions and return value pass through). A wrapper costs
one Python call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
import torch.optim.lr_scheduler as lr_scheduler

from ampwatch.agent import errors, grad_clip

Before = Callable[[tuple, dict], Any]
After = Callable[[Any, tuple, dict, Any], None]
Replace = Callable[[Callable, tuple, dict], Any]
NOT_HANDLED = object()  # what a `replace` listener returns to let the original run


class GlobalPatch:
    """Replace `owner.attr` on every owner by one wrapper while listeners exist.

    `bind(original, args, kwargs)`, when given, turns a call's arguments into keyword
    arguments once, before any listener sees them (a generator argument can be read
    once); a call it cannot bind goes to the original untouched, to fail as it would.
    """

    def __init__(self, name: str, targets: list[tuple[Any, str]],
                 bind: Callable[[Callable, tuple, dict], dict] | None = None) -> None:
        self.name = name
        self._targets = targets
        self._bind = bind
        self._originals: list[Any] = []
        self._wrappers: list[Any] = []
        self._listeners: list[tuple[Before | None, After | None]] = []
        self._replace: Replace | None = None
        self._lock = threading.Lock()
        self._depth = threading.local()

    def add(self, before: Before | None = None, after: After | None = None,
            replace: Replace | None = None) -> object:
        """Register a listener; returns a token for `remove`. `replace(original, args,
        kwargs)` may perform the call itself (returning its result) or return
        NOT_HANDLED; one listener at a time may replace."""
        token = (before, after)
        with self._lock:
            if not self._listeners:
                self._install()
            self._listeners.append(token)
            if replace is not None and self._replace is None:
                self._replace = replace
                token = (before, after, replace)
        return token

    def remove(self, token: object) -> None:
        with self._lock:
            if len(token) == 3 and self._replace is token[2]:  # type: ignore[arg-type]
                self._replace = None
            pair = token[:2]  # type: ignore[index]
            if pair in self._listeners:
                self._listeners.remove(pair)
                if not self._listeners:
                    self._uninstall()

    def _install(self) -> None:
        self._originals = [getattr(owner, attr) for owner, attr in self._targets]
        self._wrappers = [self._wrap(orig) for orig in self._originals]
        for (owner, attr), wrapper in zip(self._targets, self._wrappers, strict=True):
            setattr(owner, attr, wrapper)

    def _uninstall(self) -> None:
        for (owner, attr), orig, wrapper in zip(self._targets, self._originals,
                                                 self._wrappers, strict=True):
            if owner.__dict__.get(attr) is wrapper:  # someone may have wrapped us since
                setattr(owner, attr, orig)
        self._originals, self._wrappers = [], []

    def _wrap(self, original: Callable) -> Callable:
        patch = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(patch._depth, "n", 0)
            if depth or not patch._listeners:  # nested calls (chained schedulers) count once
                return original(*args, **kwargs)
            if patch._bind is not None:
                try:
                    args, kwargs = (), patch._bind(original, args, kwargs)
                except Exception:  # noqa: BLE001 - the caller's mistake: torch's own error
                    return original(*args, **kwargs)
            listeners = list(patch._listeners)
            tokens = []
            for before, _ in listeners:
                tokens.append(_safe(patch.name, before, args, kwargs) if before else None)
            patch._depth.n = 1
            try:
                result = NOT_HANDLED
                if patch._replace is not None:
                    result = patch._replace(original, args, kwargs)
                if result is NOT_HANDLED:
                    result = original(*args, **kwargs)
            finally:
                patch._depth.n = 0
            for (_, after), token in zip(listeners, tokens, strict=True):
                if after:
                    _safe(patch.name, after, result, args, kwargs, token)
            return result

        wrapper.__ampwatch_original__ = original  # type: ignore[attr-defined]
        return wrapper


def _safe(site: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        errors.report(site, exc)
        return None


def _scheduler_classes() -> list[tuple[Any, str]]:
    classes = [c for c in vars(lr_scheduler).values()
               if isinstance(c, type) and "step" in c.__dict__
               and (issubclass(c, lr_scheduler.LRScheduler) or c.__name__ == "ReduceLROnPlateau")]
    return [(c, "step") for c in classes]


CLIP_GRAD_NORM = GlobalPatch("clip_grad_norm_", [(torch.nn.utils, "clip_grad_norm_"),
                                                 (torch.nn.utils.clip_grad, "clip_grad_norm_")],
                             bind=grad_clip.bind)
# the newer pair (accelerate clips with get_total_norm + clip_grads_with_norm_); torch's own
# clip_grad_norm_ calls the private name, so a clip_grad_norm_ call is seen once
CLIP_GRADS_WITH_NORM = GlobalPatch("clip_grads_with_norm_",
                                   [(torch.nn.utils, "clip_grads_with_norm_")],
                                   bind=grad_clip.bind)
BACKWARD = GlobalPatch("Tensor.backward", [(torch.Tensor, "backward")])
ZERO_GRAD = GlobalPatch("zero_grad", [(torch.optim.Optimizer, "zero_grad"),
                                      (torch.nn.Module, "zero_grad")])
SCHEDULER_STEP = GlobalPatch("LRScheduler.step", _scheduler_classes())
COMPILE = GlobalPatch("torch.compile", [(torch, "compile")])
MODULE_COMPILE = GlobalPatch("Module.compile", [(torch.nn.Module, "compile")])
