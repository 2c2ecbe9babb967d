"""The training-loop observer: hooks and wrappers that turn the loop into step events.

Step N begins at `scaler.step(optimizer)` (or the optimizer's own step when there is no
scaler) and ends when it returns. Its record is closed at the first `scaler.update()`
after it (which sets `scale_after`), at once without a scaler, or at the latest before
any device write of step N+1; closing writes the sealed step into the device buffer and
issues its one non-blocking host copy. No method here synchronises the device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as optim_hooks
from torch import nn
from torch.amp.grad_scaler import OptState

from ampwatch.agent import distributed, errors
from ampwatch.agent.attribution import BackwardOwner
from ampwatch.agent.buffer import StepBuffer
from ampwatch.agent.clock import CudaClock, HostClock
from ampwatch.agent.collectors.base import EVENTS, Collector, overrides
from ampwatch.agent.compiled import CompileCounter, is_compiled, is_compiled_wrapper, unwrap
from ampwatch.agent.forward_entries import ForwardEntries
from ampwatch.agent.grad_snapshot import GradSnapshot
from ampwatch.agent.layers import Layer
from ampwatch.agent.loop_patches import PatchListeners
from ampwatch.agent.scaler_wrappers import ScalerWrappers
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.split_params import SplitParams

CLOSE_FAILED = object()  # meta of a collector whose close() raised: its fields are left out


@dataclass
class StepItem:
    """A closed step on its way to the worker: the host copy and each collector's meta."""

    step: int
    host: torch.Tensor
    ready: Any  # CUDA event to wait for before reading `host`, or None
    meta: dict[str, Any]


class LoopWatch:
    """Owns the hooks of one attachment and the step lifecycle (training thread).

    What it owns, each in its module: the forward entry hooks and torch.compile handling
    (`forward`, forward_entries.py), the listeners on global torch functions (loop_patches.py),
    the GradScaler's wrappers (scaler_wrappers.py) and the gradient snapshot (`grad_snapshot`,
    grad_snapshot.py); the collectors get its events through `dispatch`.

    `host_reduce`: the model's device is the host (CPU), so statistics tensors are already
    host memory and collectors may hand them to the worker as they are, to be reduced
    there, instead of spending device ops on the training thread to reduce them into the
    step buffer (on an accelerator those ops are asynchronous launches; on the CPU they run
    right there, at 10-60 us each in a real step).

    `on_run_change()`: the run's registration body changed (a collector learned the
    layers' order, token counts, FP8 layout); `on_event(kind, detail)`: queue an event.
    """

    HOST_REDUCE_DEVICES = ("cpu",)

    def __init__(self, model: nn.Module, scaler: Any, optimizer: Any, layers: list[Layer],
                 collectors: list[Collector], sink: Callable[[StepItem], bool],
                 settings: AgentSettings, *,
                 on_run_change: Callable[[], None] = lambda: None,
                 on_event: Callable[[str, dict[str, Any]], Any] = lambda kind, detail: None,
                 ) -> None:
        self.model = model
        self.inner = unwrap(model)  # the user's model inside torch.compile wrappers
        self.compiled = is_compiled(model)  # no per-layer hooks (see agent/compiled.py)
        self.compiles = CompileCounter()
        self.scaler = scaler
        self.optimizer = optimizer
        self.layers = layers
        self.collectors = collectors
        self.settings = settings
        self.sink = sink
        self.on_run_change = on_run_change
        self.on_event = on_event
        self.params = list(dict.fromkeys(model.parameters()))
        self.param_ids = {id(p) for p in self.params}
        first = next(iter(self.params), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.device_type = self.device.type
        self.host_reduce = (self.device_type in self.HOST_REDUCE_DEVICES
                            and not settings.device_path)
        self.rank, self.world_size = settings.rank, settings.world_size
        self.parallelism = distributed.parallelism(model, self.params)
        self.grad_layout = distributed.grad_layout(self.parallelism, self.world_size)
        self.backward_owner = BackwardOwner(self.param_ids, self.parallelism)
        self.split_params = SplitParams(self.params)
        self.buffer = StepBuffer(self.device)
        self.clock: HostClock | CudaClock = (
            CudaClock() if self.device_type == "cuda" else HostClock())
        self.step = settings.first_step if settings.first_step is not None else 0
        self.active = False
        self.suspended = False  # set during check_speedup's private runs
        self.in_training_forward = False
        self._said_capture = False  # capturing() told the server once
        self.training_autocast: str | None = None  # autocast dtype of training forwards
        self.fp16_params = any(p.dtype == torch.float16 for p in self.params)
        self.fp16_outputs = False  # a sampled forward saw a layer compute in float16
        self.anomaly_until = -1  # sample activations through this step (worker sets it too)
        self.dropped_steps = 0
        self._pending: tuple[int, bool, dict[str, Any]] | None = None
        self._handles: list[Any] = []
        self.forward = ForwardEntries(self)
        self.grad_snapshot = GradSnapshot(self)
        self._patches = PatchListeners(self)
        self._scaler_wrappers = ScalerWrappers(self)
        # per event, the bound handlers of the collectors that implement it
        self._listeners = {e: [(getattr(c, e), f"{c.name}.{e}") for c in collectors
                               if overrides(c, e)] for e in EVENTS}
        # the step guard's stop check (agent/step_guard.py): it may raise, on purpose
        self._after_step = [c.after_step for c in collectors if overrides(c, "after_step")]
        self.take_grads_guarded = errors.guarded("watch.grad_snapshot")(self.grad_snapshot.take)
        self.step_end_guarded = errors.guarded("watch.step_end")(self._step_end)

    def __deepcopy__(self, memo: dict) -> LoopWatch:
        """A deep copy of the watched model (an EMA copy, `AveragedModel`) copies its hooks,
        bound to this watch: they get an inactive twin, so the copy trains and
        evaluates unwatched and the copy needs no thread lock copied."""
        twin = copy.copy(self)
        twin.active = False
        return twin

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        for collector in self.collectors:
            collector.reserve(self.buffer)
        self.buffer.allocate()
        for collector in self.collectors:
            collector.bind(self)
        self.forward.install()
        self._handles.append(optim_hooks.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(optim_hooks.register_optimizer_step_post_hook(self._opt_post))
        self._patches.install()
        self._scaler_wrappers.install()
        self.active = True
        if self.compiled:
            self.compiles.start()
            if not is_compiled_wrapper(self.model):
                self.forward.wrap_inplace_compiled(self.inner)
        self.dispatch("on_next_step", self.step)

    def keep_handle(self, handle: Any) -> None:
        """A hook handle that `uninstall()` removes."""
        self._handles.append(handle)

    def uninstall(self) -> None:
        """Remove every hook, wrapper and patch; idempotent."""
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.uninstall()
        self._scaler_wrappers.uninstall()
        self.forward.uninstall()
        self.compiles.stop()
        for collector in self.collectors:
            collector.unbind()

    @property
    def forward_owner(self) -> nn.Module | None:
        """The module running the current forward (None between forwards)."""
        return self.forward.owner

    @property
    def forward_entry(self) -> str:
        """The name in the model of the module running the current forward ("": the
        model itself), for a replay to call the same one."""
        return self.forward.entry

    def dispatch(self, event: str, *args: Any) -> None:
        for handler, site in self._listeners[event]:
            try:
                handler(*args)
            except Exception as exc:  # noqa: BLE001
                errors.report(site, exc)

    def capturing(self) -> bool:
        """Whether the current CUDA stream is capturing a CUDA graph: what the agent would
        launch then would be recorded into the graph, and its hooks never run on replay.
        Said once (an `unsupported` event); a host query, no sync."""
        if self.device_type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return False
        if not self._said_capture:
            self._said_capture = True
            self.note_unsupported("cuda_graph_capture", [])
        return True

    @property
    def live(self) -> bool:
        return self.active and not self.suspended

    @property
    def scaler_enabled(self) -> bool:
        return self.scaler is not None and bool(getattr(self.scaler, "_enabled", True))

    def set_step(self, step: int) -> None:
        """Number the next step `step` (the trainer's own step count)."""
        self.step = int(step)
        self.dispatch("on_next_step", self.step)

    def adopt(self, optimizer: Any) -> bool:
        """Is `optimizer` the one training this model? Adopts the first that matches."""
        if self.optimizer is not None:
            return optimizer is self.optimizer
        if any(id(p) in self.param_ids for g in optimizer.param_groups for p in g["params"]):
            self.optimizer = optimizer
            return True
        return False

    def grads_unscaled(self) -> bool:
        """Whether the scaler (if any) has unscaled the grads of this step (host state)."""
        if not self.scaler_enabled:
            return True
        states = getattr(self.scaler, "_per_optimizer_states", {})
        if self.optimizer is not None:
            state = states.get(id(self.optimizer))
            return state is not None and state["stage"] is OptState.UNSCALED
        return any(s["stage"] is OptState.UNSCALED for s in states.values())

    @property
    def computes_in_fp16(self) -> bool:
        """Whether training runs in float16 (autocast, the weights, or layer outputs, as
        FSDP's mixed precision computes): the one precision whose narrow range flushes
        small gradients to zero."""
        return (self.fp16_params or self.fp16_outputs
                or self.training_autocast == "float16")

    # ------------------------------------------------------------------ step lifecycle
    def step_begin(self) -> None:
        self.close_pending()
        self.dispatch("on_step_begin", self.step)

    def _step_end(self, stepped: bool) -> None:
        step = self.step
        self.dispatch("on_step_end", step, stepped)
        sealed = {}
        for collector in self.collectors:
            try:
                sealed[collector.name] = collector.seal()
            except Exception as exc:  # noqa: BLE001
                errors.report(f"{collector.name}.seal", exc)
        self._pending = (step, stepped, sealed)
        self.step = step + 1
        self.grad_snapshot.step_ended()
        self.backward_owner.step_ended()
        if not self.scaler_enabled:
            self.close_pending()
        self.dispatch("on_next_step", self.step)

    @property
    def has_pending(self) -> bool:
        """A sealed step waits to be closed (at the scaler's update, or before the next
        step's first device write)."""
        return self._pending is not None

    @errors.guarded("watch.close")
    def close_pending(self) -> None:
        """Write the sealed step into the buffer, copy it to the host, hand it over."""
        if self._pending is None:
            return
        step, _, sealed = self._pending
        self._pending = None
        meta: dict[str, Any] = {}
        for collector in self.collectors:
            try:
                meta[collector.name] = collector.close(sealed.get(collector.name))
            except Exception as exc:  # noqa: BLE001
                errors.report(f"{collector.name}.close", exc)
                meta[collector.name] = CLOSE_FAILED
        snap = self.buffer.snapshot()
        if snap is None or not self.sink(StepItem(step, snap[0], snap[1], meta)):
            self.dropped_steps += 1
            if snap is not None:
                self.buffer.release(snap[0])

    def note_unsupported(self, signal: str, layers: list[str]) -> None:
        """Say once that `signal` cannot be recorded for `layers` (an `unsupported` event)."""
        self.on_event("unsupported", {"signal": signal, "layers": layers,
                                      "parallelism": self.parallelism})

    def note_anomaly(self, step: int) -> None:
        """Sample activations every step for the next K steps (any thread)."""
        self.anomaly_until = max(self.anomaly_until, step + self.settings.sample_after_anomaly)

    def samples(self, step: int) -> bool:
        """Whether `step` is sampled (every `sample_every` steps and through the anomaly
        window). Never on a compiled model: (un)registering the sampling hooks would
        recompile it (see agent/compiled.py)."""
        every = self.settings.sample_every
        return not self.compiled and (
            (every > 0 and step % every == 0) or step <= self.anomaly_until)

    def note_compiled(self) -> None:
        """The model was compiled after attach: no per-layer hooks from now on."""
        self.compiled = True
        self.compiles.start()
        self.dispatch("on_next_step", self.step)  # drops the per-layer hooks

    def log_loss(self, loss: Any) -> None:
        """Record `loss` as (part of) the next step's loss, in place of what the agent
        sees by itself; does not synchronise the device."""
        if self.live:
            self.dispatch("on_loss_logged", loss)

    # ------------------------------------------------------------------ optimizer hooks
    def _opt_pre(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """Step begin; the grads are read now, or, for `step(closure)`, after the closure
        has computed them (a closure's forward and backward belong to this step)."""
        try:
            if not self.live or self._scaler_wrappers.in_step or not self.adopt(optimizer):
                return None
            self.step_begin()
            own = 1 if args and args[0] is optimizer else 0  # the hook's args hold self
            if len(args) > own and callable(args[own]):
                wrapped = self._closure_then_grads(args[own])
                return (*args[:own], wrapped, *args[own + 1:]), kwargs
            if callable(kwargs.get("closure")):
                return args, {**kwargs, "closure": self._closure_then_grads(kwargs["closure"])}
            self.grad_snapshot.at_step()
        except Exception as exc:  # noqa: BLE001
            errors.report("watch.optimizer_pre", exc)
        return None

    def _closure_then_grads(self, closure: Callable) -> Callable:
        """The closure, then the grad snapshot (unless a clip inside it took one). Later
        calls (LBFGS re-evaluates) are not recorded: their losses and forwards are the
        optimizer's line search, not more training data."""
        calls = 0

        def closure_then_grads(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                suspended, self.suspended = self.suspended, True
                try:
                    return closure(*args, **kwargs)
                finally:
                    self.suspended = suspended
            result = closure(*args, **kwargs)
            self.take_grads_guarded()
            return result

        return closure_then_grads

    def _opt_post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        try:
            if not self.live or optimizer is not self.optimizer:
                return
            if self._scaler_wrappers.in_step:
                self._scaler_wrappers.opt_stepped = True
            else:
                self._step_end(stepped=True)
        except Exception as exc:  # noqa: BLE001
            errors.report("watch.optimizer_post", exc)
            return
        if self.live and optimizer is self.optimizer:
            for after_step in self._after_step:
                after_step()
