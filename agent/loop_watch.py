"""The training-loop observer: hooks and wrappers that turn the loop into step events.

Step N begins at `scaler.step(optimizer)` (or the optimizer's own step when there is no
scaler) and ends when it returns. Its record is closed at the first `scaler.update()`
after it (which sets `scale_after`), at once without a scaler, or at the latest before
any device write of step N+1; closing writes the sealed step into the device buffer and
issues its one non-blocking host copy. No method here synchronises the device.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any

import torch
import torch.optim.optimizer as optim_hooks
from torch import nn
from torch.amp.grad_scaler import OptState

from ampwatch.agent import distributed, errors, patches
from ampwatch.agent.attribution import BackwardOwner
from ampwatch.agent.buffer import StepBuffer
from ampwatch.agent.clock import CudaClock, HostClock
from ampwatch.agent.collectors.base import EVENTS, Collector, overrides
from ampwatch.agent.compiled import CompileCounter, is_compiled, is_compiled_wrapper, unwrap
from ampwatch.agent.layers import Layer
from ampwatch.agent.settings import AgentSettings
from ampwatch.agent.split_params import SplitParams

_SCALER_METHODS = ("scale", "unscale_", "step", "update")
CLOSE_FAILED = object()  # meta of a collector whose close() raised: its fields are left out
_compiling = torch.compiler.is_compiling  # dynamo folds it to True while tracing a hook


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (host only)."""
    return torch._C._current_graph_task_id() != -1
_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


def _unwrap_scaler_method(scaler: Any, name: str, wrapper: Callable) -> None:
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


@dataclass
class StepItem:
    """A closed step on its way to the worker: the host copy and each collector's meta."""

    step: int
    host: torch.Tensor
    ready: Any  # CUDA event to wait for before reading `host`, or None
    meta: dict[str, Any]


class LoopWatch:
    """Owns the hooks of one attachment and the step lifecycle (training thread).

    `host_reduce`: the model's device is the host (CPU), so statistics tensors are already
    host memory and collectors may hand them to the worker as they are, to be reduced
    there, instead of spending device ops on the training thread to reduce them into the
    step buffer (on an accelerator those ops are asynchronous launches; on the CPU they run
    right there, at 10-60 us each in a real step).
    """

    HOST_REDUCE_DEVICES = ("cpu",)

    def __init__(self, model: nn.Module, scaler: Any, optimizer: Any, layers: list[Layer],
                 collectors: list[Collector], sink: Callable[[StepItem], bool],
                 settings: AgentSettings) -> None:
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
        self.params = list(dict.fromkeys(model.parameters()))
        self._param_ids = {id(p) for p in self.params}
        first = next(iter(self.params), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.device_type = self.device.type
        self.host_reduce = (self.device_type in self.HOST_REDUCE_DEVICES
                            and not settings.device_path)
        self.rank, self.world_size = settings.rank, settings.world_size
        self.parallelism = distributed.parallelism(model, self.params)
        self.grad_layout = distributed.grad_layout(self.parallelism, self.world_size)
        self._owner = BackwardOwner(self._param_ids, self.parallelism)
        self._split = SplitParams(self.params)
        self._backward_ours = False  # the backward under way is the model's own
        self.buffer = StepBuffer(self.device)
        self.clock: HostClock | CudaClock = (
            CudaClock() if self.device_type == "cuda" else HostClock())
        self.step = 0
        self.active = False
        self.suspended = False  # set during check_speedup's private runs
        self.in_training_forward = False
        self.training_autocast: str | None = None  # autocast dtype of training forwards
        self.fp16_params = any(p.dtype == torch.float16 for p in self.params)
        self.fp16_outputs = False  # a sampled forward saw a layer compute in float16
        self.anomaly_until = -1  # sample activations through this step (worker sets it too)
        self.dropped_steps = 0
        self._grads_taken = False
        # the grads' version counters summed as the snapshot (or an unscale_ or a clip the
        # agent saw) left them: a different sum at the step means something else rewrote them
        self._grad_versions: tuple[tuple[int, ...], int] | None = None
        self._clipping_ours = False  # set by _clip_before for the clip call under way
        self._in_scaler_step = False
        self._opt_stepped = False
        self._pending: tuple[int, bool, dict[str, Any]] | None = None
        self._forward_owner: nn.Module | None = None  # the module whose hooks run this forward
        # the modules a forward may enter by (the loop may call a submodule itself: a
        # LightningModule's `self.net(x)`), by their names in the model ("": the model)
        self._entries: dict[int, str] = {}
        self._inplace_compiled: list[tuple[nn.Module, Callable]] = []
        self._handles: list[Any] = []
        self._patch_tokens: list[tuple[patches.GlobalPatch, object]] = []
        self._scaler_wrapped: list[tuple[str, Callable]] = []  # (method, our wrapper)
        # per event, the bound handlers of the collectors that implement it
        self._listeners = {e: [(getattr(c, e), f"{c.name}.{e}") for c in collectors
                               if overrides(c, e)] for e in EVENTS}
        self._take_grads_guarded = errors.guarded("watch.grad_snapshot")(self._take_grads)
        self._step_end_guarded = errors.guarded("watch.step_end")(self._step_end)
        self.on_run_change: Callable[[], None] = lambda: None
        self.on_event: Callable[[str, dict[str, Any]], Any] = lambda kind, detail: None
        # the step guard's stop check (agent/step_guard.py): it may raise, on purpose
        self.after_step: Callable[[], None] | None = None

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
        for name, module in self._entry_modules():
            self._entries[id(module)] = name
            self._hook_forward(module)
        self._handles.append(optim_hooks.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(optim_hooks.register_optimizer_step_post_hook(self._opt_post))
        self._patch_tokens = [
            (patches.BACKWARD, patches.BACKWARD.add(self._backward_before, self._backward_after)),
            (patches.ZERO_GRAD, patches.ZERO_GRAD.add(self._zero_grad_before)),
            (patches.CLIP_GRAD_NORM, patches.CLIP_GRAD_NORM.add(
                self._clip_before, self._clip_after)),
            (patches.CLIP_GRADS_WITH_NORM, patches.CLIP_GRADS_WITH_NORM.add(
                self._clip_before, self._clip_after)),
            (patches.SCHEDULER_STEP, patches.SCHEDULER_STEP.add(self._scheduler_before)),
            (patches.COMPILE, patches.COMPILE.add(after=self._compile_after)),
            (patches.MODULE_COMPILE, patches.MODULE_COMPILE.add(after=self._module_compile_after)),
        ]
        if self.scaler is not None:
            for name in _SCALER_METHODS:
                wrapper = getattr(self, f"_wrap_{name.rstrip('_')}")(getattr(self.scaler, name))
                wrapper.__ampwatch_previous__ = self.scaler.__dict__.get(name)  # type: ignore[attr-defined]
                wrapper.__ampwatch_watch__ = self  # type: ignore[attr-defined]
                setattr(self.scaler, name, wrapper)
                self._scaler_wrapped.append((name, wrapper))
        self.active = True
        if self.compiled:
            self.compiles.start()
            if not is_compiled_wrapper(self.model):
                self._wrap_inplace_compiled(self.inner)
        self.dispatch("on_next_step", self.step)

    def _entry_modules(self) -> list[tuple[str, nn.Module]]:
        """The model, the module it wraps, and that module's children that hold parameters:
        a step's forward is whichever of them the loop calls first (a loss module or a
        metric, without parameters, is not a forward). A container's children are entered
        through the container's own forward, so only the model is hooked then."""
        entries = [("", self.model)]
        if self.inner is not self.model:
            entries.append(("", self.inner))
        if not isinstance(self.inner, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            for name, child in self.inner.named_children():
                if next(child.parameters(), None) is not None:
                    entries.append((name, child))
        return entries

    @property
    def forward_owner(self) -> nn.Module | None:
        """The module running the current forward (None between forwards)."""
        return self._forward_owner

    @property
    def forward_entry(self) -> str:
        """The name in the model of the module running the current forward ("": the
        model itself), for a replay to call the same one."""
        owner = self._forward_owner
        return "" if owner is None else self._entries.get(id(owner), "")

    def _hook_forward(self, module: nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(
            self._forward_pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(
            self._forward_post, with_kwargs=True, always_call=True))

    def uninstall(self) -> None:
        """Remove every hook, wrapper and patch; idempotent."""
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for patch, token in self._patch_tokens:
            patch.remove(token)
        self._patch_tokens.clear()
        for name, wrapper in self._scaler_wrapped:
            if self.scaler.__dict__.get(name) is wrapper:
                _unwrap_scaler_method(self.scaler, name, wrapper)
            # else another attachment sharing the scaler wrapped ours: ours stays in its
            # chain, passing calls through, until that one is detached
        self._scaler_wrapped.clear()
        for module, compiled in self._inplace_compiled:
            if getattr(module, "_compiled_call_impl", None) is not compiled:
                module._compiled_call_impl = compiled
        self._inplace_compiled.clear()
        self.compiles.stop()
        for collector in self.collectors:
            collector.unbind()

    def dispatch(self, event: str, *args: Any) -> None:
        for handler, site in self._listeners[event]:
            try:
                handler(*args)
            except Exception as exc:  # noqa: BLE001
                errors.report(site, exc)

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

    def _adopt(self, optimizer: Any) -> bool:
        """Is `optimizer` the one training this model? Adopts the first that matches."""
        if self.optimizer is not None:
            return optimizer is self.optimizer
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            self.optimizer = optimizer
            return True
        return False

    # ------------------------------------------------------------------ step lifecycle
    def _take_grads(self, divisor: torch.Tensor | None = None, again: bool = False) -> None:
        """The step's gradient snapshot. Taken as each of the model's backwards ends
        (`again`: the last one before the step wins), so the grads are as backward left
        them, before whatever clips or rescales them; taken at the step instead when no
        backward was seen (one the agent cannot observe). `divisor`: the scale the grads
        still carry (GradScaler's, on device: no synchronisation)."""
        if self._grads_taken and not again:
            return
        self._grads_taken = True
        self.close_pending()
        present = self._present()
        with_grad = [self.params[i] for i in present]
        grads = [p.grad for p in with_grad]
        if divisor is None and self.scaler_enabled and self.optimizer is not None:
            grads = self._split.unscale(self.optimizer, present, grads, self.scaler._scale)
        self.dispatch("on_grads", grads, present, divisor)
        self._note_grad_versions(present)

    def _note_grad_versions(self, present: tuple[int, ...] | None = None) -> None:
        """Remember the grads' version counters (host counters: no device work)."""
        if present is None:
            if self._grad_versions is None:
                return
            present = self._grad_versions[0]
        params = self.params
        try:
            versions = sum(map(_VERSION, (params[i].grad for i in present)))
        except AttributeError:  # a grad dropped since: nothing left to compare
            self._grad_versions = None
            return
        self._grad_versions = (present, versions)

    def _grads_at_step(self, divisor: torch.Tensor | None = None) -> None:
        """At the optimizer step: the snapshot if no backward took it; else, when the grads
        were rewritten since (a clip the agent did not see called, a loop's own scaling),
        their norm as the optimizer gets them is the clipped norm."""
        if not self._grads_taken:
            self._take_grads(divisor)
            return
        taken = self._grad_versions
        if taken is None:
            return
        present, versions = taken
        params = self.params
        try:
            grads = [params[i].grad for i in present]
            if sum(map(_VERSION, grads)) == versions:
                return
        except AttributeError:  # a grad dropped since
            return
        self._grad_versions = None
        if divisor is None and not self._grads_unscaled():
            divisor = self.scaler._scale
        self.dispatch("on_grads_rewritten", grads, divisor)

    @property
    def computes_in_fp16(self) -> bool:
        """Whether training runs in float16 (autocast, the weights, or layer outputs, as
        FSDP's mixed precision computes): the one precision whose narrow range flushes
        small gradients to zero."""
        return (self.fp16_params or self.fp16_outputs
                or self.training_autocast == "float16")

    def _present(self) -> tuple[int, ...]:
        """The positions of the params that have a grad (iterated in C: once per step)."""
        params = self.params
        return tuple(compress(range(len(params)),
                              map(operator.is_not, map(_GRAD, params), repeat(None))))

    def _step_begin(self) -> None:
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
        self._grads_taken = False
        self._grad_versions = None
        self._owner.step_ended()
        if not self.scaler_enabled:
            self.close_pending()
        self.dispatch("on_next_step", self.step)

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

    # ------------------------------------------------------------------ hooks
    # Traced by dynamo (a model compiled after attach), a hook returns at once: nothing is
    # added to the graph. The compile wrapper's hooks run eagerly around the compiled call;
    # the owner check keeps one forward from counting twice when dynamo falls back to eager.
    def _forward_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _compiling() or not self.live or self._forward_owner is not None:
            return
        if module is not self.model and _in_backward():  # checkpointing's recompute
            return
        self._forward_owner = module
        self._owner.forward_ran()
        training = self.inner.training if module is self.model else module.training
        self.in_training_forward = training
        self.dispatch("on_forward_begin", training, args, kwargs)

    def _forward_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _compiling() or module is not self._forward_owner:
            return
        self._forward_owner = None
        self.in_training_forward = False
        if self.live:
            self.dispatch("on_forward_end", self.inner.training, output)

    # ------------------------------------------------------------------ torch.compile
    def _compile_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        target = args[0] if args else kwargs.get("model")
        if not self.active or not isinstance(target, nn.Module) or not self._owns(target):
            return
        if (target is self.inner or target is self.model) and is_compiled_wrapper(result):
            self._hook_forward(result)  # its hooks run eagerly around the compiled call
        self._note_compiled()

    def _module_compile_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        module = args[0]
        if self.active and self._owns(module):
            if module is self.inner:
                self._wrap_inplace_compiled(module)
            self._note_compiled()

    def _owns(self, module: nn.Module) -> bool:
        return module is self.model or any(m is module for m in self.inner.modules())

    def _note_compiled(self) -> None:
        self.compiled = True
        self.compiles.start()
        self.dispatch("on_next_step", self.step)  # drops the per-layer hooks

    def _wrap_inplace_compiled(self, module: nn.Module) -> None:
        """`module.compile()` compiles its `_call_impl`, hooks included: run ours eagerly
        around the compiled call instead."""
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is None or any(m is module for m, _ in self._inplace_compiled):
            return
        pre, post = self._forward_pre, self._forward_post

        def call_with_hooks(*args: Any, **kwargs: Any) -> Any:
            pre(module, args, kwargs)
            output = None
            try:
                output = compiled(*args, **kwargs)
            finally:
                post(module, args, kwargs, output)
            return output

        module._compiled_call_impl = call_with_hooks
        self._inplace_compiled.append((module, compiled))

    # Tensor.backward is wrapped for the whole process: only the model's own backward
    # (its graph reaches the model's parameters) is dispatched (agent/attribution.py)
    def _backward_before(self, args: tuple, kwargs: dict) -> None:
        self._backward_ours = False
        if not self.live:
            return
        self._backward_ours, loss = self._owner.claim(args[0], self.scaler_enabled)
        if self._backward_ours:
            self.dispatch("on_backward_begin", loss)

    def _backward_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        if self._backward_ours and self.live:
            self._backward_ours = False
            self.dispatch("on_backward_end")
            self._take_grads_guarded(self.scaler._scale if self.scaler_enabled else None,
                                     again=True)

    def _zero_grad_before(self, args: tuple, kwargs: dict) -> None:
        """The loop drops the model's grads (its optimizer's or the model's `zero_grad`):
        the losses and backwards that made them do not belong to the next step."""
        owner = args[0]
        if self.live and (owner is self.optimizer or owner is self.model
                          or owner is self.inner):
            self.dispatch("on_zero_grad")

    def log_loss(self, loss: Any) -> None:
        """Record `loss` as (part of) the next step's loss, in place of what the agent
        sees by itself; does not synchronise the device."""
        if self.live:
            self.dispatch("on_loss_logged", loss)

    def _grads_unscaled(self) -> bool:
        if not self.scaler_enabled:
            return True
        states = getattr(self.scaler, "_per_optimizer_states", {})
        if self.optimizer is not None:
            state = states.get(id(self.optimizer))
            return state is not None and state["stage"] is OptState.UNSCALED
        return any(s["stage"] is OptState.UNSCALED for s in states.values())

    # clip_grad_norm_'s and clip_grads_with_norm_'s arguments arrive bound
    # (patches.CLIP_GRAD_NORM): `parameters` is a list. The snapshot was taken as backward
    # ended; these calls only say whether the loop clipped unscaled grads, and by how much.
    def _clip_before(self, args: tuple, kwargs: dict) -> bool | None:
        """Whether the grads were unscaled; None when the call clips no parameter of this
        model (another model in the process: a discriminator, an EMA copy)."""
        self._clipping_ours = self.live and not self._param_ids.isdisjoint(
            map(id, kwargs["parameters"]))
        if not self._clipping_ours:
            return None
        unscaled = self._grads_unscaled()
        if unscaled and not self._grads_taken:  # no backward seen: before the clip, at least
            self._take_grads_guarded()
        self.dispatch("on_clip_begin", unscaled)
        return unscaled

    def _clip_after(self, result: Any, args: tuple, kwargs: dict, unscaled: Any) -> None:
        if unscaled is not None and self.live:
            self._note_grad_versions()  # a clip seen: its norm is derived, not re-read
            total = kwargs.get("total_norm", result)
            self.dispatch("on_clip_end", total, kwargs["max_norm"], unscaled)

    def _scheduler_before(self, args: tuple, kwargs: dict) -> None:
        scheduler = args[0]
        if self.live and getattr(scheduler, "_step_count", 1) != 0:  # 0: its __init__ step
            self.dispatch("on_scheduler_step", getattr(scheduler, "optimizer", None))

    def _opt_pre(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """Step begin; the grads are read now, or, for `step(closure)`, after the closure
        has computed them (a closure's forward and backward belong to this step)."""
        try:
            if not self.live or self._in_scaler_step or not self._adopt(optimizer):
                return None
            self._step_begin()
            own = 1 if args and args[0] is optimizer else 0  # the hook's args hold self
            if len(args) > own and callable(args[own]):
                wrapped = self._closure_then_grads(args[own])
                return (*args[:own], wrapped, *args[own + 1:]), kwargs
            if callable(kwargs.get("closure")):
                return args, {**kwargs, "closure": self._closure_then_grads(kwargs["closure"])}
            self._grads_at_step()
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
            self._take_grads_guarded()
            return result

        return closure_then_grads

    def _opt_post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        try:
            if not self.live or optimizer is not self.optimizer:
                return
            if self._in_scaler_step:
                self._opt_stepped = True
            else:
                self._step_end(stepped=True)
        except Exception as exc:  # noqa: BLE001
            errors.report("watch.optimizer_post", exc)
            return
        if self.after_step is not None and self.live and optimizer is self.optimizer:
            self.after_step()

    # ------------------------------------------------------------------ scaler wrappers
    def _wrap_scale(self, original: Callable) -> Callable:
        def scale(outputs: Any) -> Any:
            if not self.live:
                return original(outputs)
            self.dispatch("on_scale", outputs)
            scaled = original(outputs)
            try:
                self._owner.scaled.note(outputs, scaled)
            except Exception as exc:  # noqa: BLE001
                errors.report("watch.scale", exc)
            return scaled
        return scale

    def _wrap_unscale(self, original: Callable) -> Callable:
        def unscale_(optimizer: Any) -> None:
            original(optimizer)
            if self.live:
                try:
                    if not self._adopt(optimizer):
                        self._split.unscaled_by(optimizer)
                    elif self._in_scaler_step:
                        self._take_grads()  # no backward seen: the grads are final now
                    self._note_grad_versions()  # unscaling rewrote them, as expected
                except Exception as exc:  # noqa: BLE001
                    errors.report("watch.unscale_", exc)
        return unscale_

    def _wrap_step(self, original: Callable) -> Callable:
        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                ours = self.live and self._adopt(optimizer)
                if ours:
                    self._step_begin()
                    if self._grads_unscaled():
                        self._grads_at_step()
                    elif getattr(optimizer, "_step_supports_amp_scaling", False):
                        self._grads_at_step(divisor=self.scaler._scale)  # fused: stay scaled
            except Exception as exc:  # noqa: BLE001
                errors.report("watch.step", exc)
                ours = False
            if not ours:
                return original(optimizer, *args, **kwargs)
            self._in_scaler_step, self._opt_stepped = True, False
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self._in_scaler_step = False
                self._step_end_guarded(self._opt_stepped)
        return step

    def _wrap_update(self, original: Callable) -> Callable:
        def update(new_scale: Any = None) -> None:
            if self.live:
                self.dispatch("on_update_begin")
            original(new_scale)
            self._split.updated()
            if self.live:
                closing = self._pending is not None
                self.dispatch("on_update_end", closing)
                if closing:
                    self.close_pending()
        return update
