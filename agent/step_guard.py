"""The step guard (`attach(..., guard=True)`): leaves a bad optimizer step out, exactly.

Not to be confused with `agent/errors.py`, the error boundary that keeps the agent's own
exceptions out of training. This one acts on training itself, and only when asked.

Without an enabled GradScaler (bf16, fp32), a step whose loss or gradients are not finite
(or, with `skip_spikes=k`, whose loss is over k times the median of the recent healthy
losses) is left out the way GradScaler leaves one out: the weights and the optimizer state
(Adam's step counter included) stay bit for bit as if `step()` had not been called; the
loop's LR scheduler steps as usual, as it does for a GradScaler user. The decision is a
device tensor (agreed across ranks with one all_reduce); how it acts depends on `mode`:

- "found_inf": optimizers with `_step_supports_amp_scaling` (fused Adam, AdamW, SGD) get
  it as their `found_inf`, as GradScaler does: no host sync, no copy;
- "select": the params with grads and their state are copied before the step and put back
  by `torch.where` after it (no host sync; one extra copy of params and state in memory);
- "sync": the flag is read on the host (one sync a step) and a bad step's grads are
  dropped (set to None) before the optimizer runs, so it changes nothing.

"auto" takes found_inf when the optimizer has it, else sync on the CPU (a read there waits
for nothing) and select on an accelerator. A step that would create optimizer state (the
first, lazily initialised) is decided on the host: a skipped one must leave none behind.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ampwatch.agent import errors
from ampwatch.agent.collectors.base import Collector
from ampwatch.wire import GUARD_REASONS

MODES = ("auto", "found_inf", "select", "sync")
logger = logging.getLogger(__name__)  # under `ampwatch`: one WARNING per step left out
# reason codes, most severe highest: a MAX all_reduce across ranks keeps the worst
REASONS = dict(enumerate(GUARD_REASONS, start=1))


class GuardStop(RuntimeError):
    """Raised into training by `max_skips`: the run keeps producing bad steps."""

    def __init__(self, step: int, streak: int, layer: str | None, bundle: str | None,
                 reason: str | None) -> None:
        self.step, self.streak, self.layer, self.bundle = step, streak, layer, bundle
        self.reason = reason
        super().__init__(
            f"ampwatch guard: {streak} optimizer steps in a row left out, through step "
            f"{step} (last reason: {reason}); first non-finite layer: {layer or 'unknown'}; "
            f"flight-recorder bundle: {bundle or 'none'}. Stopping so no more compute is "
            "spent on a run that cannot recover.")


@dataclass(frozen=True)
class GuardSettings:
    """What the guard leaves out (see module docstring)."""

    skip_spikes: float | None = None  # k: loss over k x median of recent healthy losses
    max_skips: int | None = None  # stop after this many guarded steps in a row
    mode: str = "auto"
    window: int = 64  # recent healthy losses the median is taken over
    min_history: int = 8  # healthy losses needed before spikes are judged

    @classmethod
    def parse(cls, value: Any) -> GuardSettings | None:
        """`guard=` of attach(): False/None (off), True, a dict or a GuardSettings."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, GuardSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"guard must be a bool, a dict or GuardSettings, got {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown guard options: {sorted(unknown)}")
        settings = cls(**value)
        k, n = settings.skip_spikes, settings.max_skips
        if k is not None and (isinstance(k, bool) or not k > 1):
            raise ValueError(f"guard skip_spikes must be a number > 1, got {k!r}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"guard max_skips must be an int >= 1, got {n!r}")
        if settings.mode not in MODES:
            raise ValueError(f"guard mode must be one of {MODES}, got {settings.mode!r}")
        if settings.window < 1 or not 1 <= settings.min_history <= settings.window:
            raise ValueError("guard needs window >= 1 and 1 <= min_history <= window")
        return settings


class StepGuard(Collector):
    """Decides before each optimizer step, acts through the optimizer's own hooks, and
    writes the step's reason code into its slot (`guarded` on the wire)."""

    name = "step_guard"
    slots = 1

    def __init__(self, settings: GuardSettings,
                 on_stop: Callable[[], str | None] = lambda: None,
                 step_number: Callable[[int], int] = lambda step: step) -> None:
        """`on_stop()`: before `GuardStop` is raised, deliver what the run has and name the
        newest flight-recorder bundle; `step_number`: a process step as the run numbers it."""
        super().__init__()
        self.settings = settings
        self.skipped_steps = 0  # guarded steps seen by the worker (host count)
        self.first_layer: str | None = None  # first non-finite layer of the current streak
        self.on_stop = on_stop
        self.step_number = step_number
        self._losses: list[Any] = []
        self._named: list[Any] = []
        self._grads: list[torch.Tensor] | None = None
        self._hooked: Any = None
        self._handles: list[Any] = []
        self._armed: str | None = None  # how this step is being guarded
        self._decided = False  # this step's decision is made (grads seen)
        self._backup: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._wrote = False
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        self._hosts: list[torch.Tensor] = []

    # ------------------------------------------------------------------ set-up
    def bind(self, watch: Any) -> None:
        super().bind(watch)
        dev = watch.device
        self._slot = self.slot(0)
        self._code = torch.zeros((), dtype=torch.int64, device=dev)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._streak = torch.zeros((), dtype=torch.int64, device=dev)
        self._hist = torch.full((self.settings.window,), math.nan, device=dev)
        self._pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self._zero = torch.zeros((), device=dev)
        self._found = torch.zeros(1, device=dev)  # GradScaler's found_inf form
        self._one = torch.ones(1, device=dev)

    def unbind(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = None

    @property
    def active(self) -> bool:
        """The guard leaves the skipping to an enabled GradScaler when there is one."""
        return self.watch is not None and not self.watch.scaler_enabled

    # ------------------------------------------------------------------ events
    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        if isinstance(loss, torch.Tensor) and loss.is_floating_point():
            self._losses.append(loss.detach())

    def on_loss_logged(self, loss: Any) -> None:
        if isinstance(loss, (torch.Tensor, float, int)) and not isinstance(loss, bool):
            self._named.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)

    def on_zero_grad(self) -> None:
        self._losses.clear()

    def on_grads(self, grads: list[torch.Tensor], present: tuple[int, ...],
                 divisor: torch.Tensor | None, norms: torch.Tensor | None) -> None:
        self._grads = grads
        if self._armed is not None and not self._decided:  # inside step(closure)
            with torch.no_grad():
                self._apply(self._hooked)

    def on_step_begin(self, step: int) -> None:
        optimizer = self.watch.optimizer
        if optimizer is not None and optimizer is not self._hooked and self.active:
            # the optimizer's own hooks run after the loop watch's global pre-hook (which
            # took the grads) and before its global post-hook (which ends the step)
            for handle in self._handles:
                handle.remove()
            self._handles = [optimizer.register_step_pre_hook(self._arm),
                             optimizer.register_step_post_hook(self._disarm)]
            self._hooked = optimizer

    # ------------------------------------------------------------------ the decision
    def _decide(self) -> None:
        """This step's reason code into `self._code` (0: healthy), on the device."""
        dev = self._code.device
        named = self._named or self._losses
        self._named, self._losses = [], []
        parts = [t.float().sum() for t in named if isinstance(t, torch.Tensor)]
        numbers = sum(float(x) for x in named if not isinstance(x, torch.Tensor))
        loss = None
        if parts or named:
            loss = (torch.stack([p.to(dev) for p in parts]).sum() if parts
                    else self._zero.clone()) + numbers
        code = torch.zeros((), dtype=torch.int64, device=dev)
        if self._grads:
            code = torch.where(self._grads_nonfinite(self._grads), 2, code)
        if loss is not None:
            code = torch.where(loss.isfinite(), code, 3)
            k = self.settings.skip_spikes
            if k is not None:
                hist = self._hist
                seen = hist.isfinite().sum()
                median = torch.nanmedian(hist)
                spike = (seen >= self.settings.min_history) & (median > 0) & (loss > k * median)
                code = torch.where(spike & (code == 0), 1, code)
            self._loss = loss
        else:
            self._loss = None
        watch = self.watch
        if watch.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(code, op=dist.ReduceOp.MAX)  # every rank leaves out the same step
        self._code.copy_(code)

    def _grads_nonfinite(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Whether any grad element is inf/NaN: GradScaler's own check, one fused kernel
        per device and dtype, with an inverse scale of 1 (x * 1.0 is x, bit for bit).
        (`_foreach_norm(inf)` would read less but is 15x slower on the CPU, and an L2
        norm overflows on huge finite grads.)"""
        found = self._found.zero_()
        groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in groups.items():
            if device == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, self._one)
            else:  # a model spread over devices: each device's verdict, then one add
                there = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    group, there, self._one.to(device))
                found.add_(there.to(found.device, non_blocking=True))
        return found[0] > 0

    def _mode(self, optimizer: Any, params: list[torch.Tensor]) -> str:
        mode = self.settings.mode
        state = optimizer.state
        if any(p not in state or not state[p] for p in params):
            return "sync"  # the step would create state: decide on the host
        if mode == "auto":
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                return "found_inf"
            return "sync" if self.watch.host_reduce else "select"
        if mode == "found_inf" and not getattr(optimizer, "_step_supports_amp_scaling", False):
            return "select"
        if mode == "select" and any(not isinstance(v, torch.Tensor)
                                    for p in params for v in state[p].values()):
            return "sync"  # Python numbers in the state cannot be selected on the device
        return mode

    def _arm(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """The optimizer's pre-hook: decide, then arm the chosen way of leaving it out."""
        self._armed = None
        try:
            with torch.no_grad():
                self._arm_step(optimizer)
        except Exception as exc:  # noqa: BLE001
            self._armed = None
            optimizer.__dict__.pop("found_inf", None)
            errors.report("step_guard.arm", exc)

    def _arm_step(self, optimizer: Any) -> None:
        if not self.active or self.watch is None or not self.watch.live:
            return
        self._code.zero_()
        self._decided = False
        taken = self._grads is not None  # else a step(closure): its grads come inside step()
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if p.grad is not None or not taken]
        mode = self._mode(optimizer, params)
        if mode == "found_inf":
            self._found_inf.zero_()  # the optimizer reads it after any closure: set then
            optimizer.found_inf = self._found_inf
        elif mode == "select":
            state = optimizer.state
            live = [*params, *(v for p in params for v in state[p].values()
                               if isinstance(v, torch.Tensor))]
            backup = self._backup
            if backup is None or len(backup[0]) != len(live) or any(
                    a is not b for a, b in zip(backup[0], live, strict=True)):
                backup = (live, [torch.empty_like(t) for t in live])
            torch._foreach_copy_(backup[1], live)
            self._backup = backup
        self._armed = mode
        if taken:
            self._apply(optimizer)

    def _apply(self, optimizer: Any) -> None:
        """Decide, now that the step's grads are in, before the optimizer reads them."""
        self._decided = True
        self._decide()
        self._grads = None
        if self._armed == "found_inf":
            self._found_inf.copy_(self._code > 0)
        elif self._armed == "sync" and bool(self._code > 0):  # the one host read of the step
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # the grads dropped: the optimizer has nothing to apply

    def _disarm(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """The optimizer's post-hook: undo a bad step (select), update the history."""
        mode, self._armed = self._armed, None
        if mode is None:
            return
        if not self._decided:  # a closure whose grads the agent did not see: not guarded
            optimizer.__dict__.pop("found_inf", None)
            return
        try:
            with torch.no_grad():
                self._disarm_step(optimizer, mode)
        except Exception as exc:  # noqa: BLE001
            optimizer.__dict__.pop("found_inf", None)
            errors.report("step_guard.disarm", exc)

    def _disarm_step(self, optimizer: Any, mode: str) -> None:
        bad = self._code > 0
        if mode == "found_inf":
            del optimizer.found_inf
        elif mode == "select" and self._backup is not None:
            for live, saved in zip(*self._backup, strict=True):
                torch.where(bad, saved, live, out=live)  # in place: elementwise, no copy
        if self._loss is not None and self.settings.skip_spikes is not None:
            # a healthy loss joins the window; a bad one writes its slot back unchanged
            old = self._hist.gather(0, self._pos)
            self._hist.scatter_(0, self._pos, torch.where(bad, old, self._loss.float()))
            self._pos.add_((~bad).long()).remainder_(self.settings.window)
        self._streak.add_(1).mul_(bad.long())
        self._wrote = True
        if self.settings.max_skips is not None:
            self._queue_streak()

    def _queue_streak(self) -> None:
        """The streak a step left, copied to the host without waiting (read once done)."""
        step = self.watch.step
        if self._streak.device.type == "cuda":
            host = (self._hosts.pop() if self._hosts
                    else torch.empty((), dtype=torch.int64, pin_memory=True))
            host.copy_(self._streak, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = self._streak.clone(), None
        self._pending.append((step, host, event))

    def after_step(self) -> None:
        """After the loop watch ended a step: stop the run once `max_skips` is reached.
        The one exception the agent raises into training on purpose."""
        limit = self.settings.max_skips
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            step, host, event = self._pending.popleft()
            streak = int(host)
            if event is not None:
                self._hosts.append(host)  # pinned buffers are reused, not allocated a step
            if limit is not None and streak >= limit:
                self._pending.clear()
                bundle = self.on_stop()
                reason = REASONS.get(int(self._code)) if streak else None
                raise GuardStop(self.step_number(step), streak, self.first_layer, bundle,
                                reason)

    # ------------------------------------------------------------------ per step record
    def seal(self) -> Any:
        wrote, self._wrote = self._wrote, False
        # a step the guard did not judge (a scaler's, an unseen closure) keeps nothing
        self._losses, self._named, self._grads = [], [], None
        return wrote

    def close(self, sealed: Any) -> Any:
        if sealed:
            self._slot.copy_(self._code)
        return sealed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        """A guarded step is a skipped step with its reason (`guarded`)."""
        code = int(host[0]) if meta else 0
        reason = REASONS.get(code)
        record["guarded"] = reason
        if reason is None:
            self.first_layer = None
            return
        record["skipped"] = True
        self.skipped_steps += 1
        logger.warning("ampwatch guard: left out step %s (%s): the optimizer did not apply "
                       "it; the LR scheduler steps as usual", record.get("step"), reason)
        first = record.get("first_nonfinite_layer")
        if self.first_layer is None and isinstance(first, int):
            self.first_layer = self.watch.layers[first].name


def weights_finite(params: list[torch.Tensor], optimizer: Any) -> bool:
    """Whether every parameter and every floating tensor of the optimizer's state is
    finite (one host read: for checkpoint time, not the hot path)."""
    tensors = [p.detach() for p in params if p.is_floating_point() and p.numel()]
    if optimizer is not None:
        tensors += [v.detach() for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    if not tensors:
        return True
    peaks = torch._foreach_norm(tensors, math.inf)
    return bool(torch.stack([p.float().to(tensors[0].device) for p in peaks]).isfinite().all())
