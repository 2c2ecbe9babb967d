"""The dtype each layer's reductions compute in: what the precision map judges a norm,
softmax or loss by, rather than the dtype the layer returns.

A Gemma- or Llama-style RMSNorm upcasts inside (`x.float()`, or `.to(torch.float32)`),
takes its variance in fp32 and casts the result back: it returns fp16 under fp16 autocast
but computes its statistics in fp32. A norm written without the upcast takes them in
fp16. What tells them apart is the dtype of the reduction ops inside the layer (mean, sum,
var, norm, the fused layer/group/RMS norms, softmax, the NLL losses), seen as they are
dispatched, after autocast has cast their inputs.

On a sampled step, layers with no child module that have not been probed under the
forward's autocast state get a pre hook that enters a `TorchDispatchMode` and a post hook
(run even if the forward raises) that leaves it; every op dispatched inside is looked at
and the narrowest dtype a reduction computed in is kept per layer. A layer that reduces
names it in its layer table entry (`attrs["reduces_in"]`, docs/wire-format.md), narrowed
only, and the run is re-registered. Each layer is probed once per autocast state, so the
cost falls on the first sampled forward of each: about 5 us per op dispatched inside the
probed layers on the CPU (a 2-layer Llama's fp16 forward, 217 ops: 1.4 ms, 2.5 ms probed);
later sampled steps hook only layers not yet seen to run, unsampled steps none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampwatch.agent import errors
from ampwatch.agent.collectors.base import Collector, SampledHooks
from ampwatch.agent.layers import dtype_name

compiling = torch.compiler.is_compiling

# aten ops whose result is a statistic over many elements: where a half dtype loses
# precision or overflows (the accumulation, the exponentials)
_REDUCTIONS = ("mean", "sum", "var", "var_mean", "std", "std_mean", "norm",
               "linalg_vector_norm", "native_layer_norm", "native_group_norm",
               "native_batch_norm", "_native_batch_norm_legit",
               "_native_batch_norm_legit_no_training", "_fused_rms_norm", "_softmax",
               "_log_softmax", "logsumexp", "nll_loss_forward", "nll_loss2d_forward",
               "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss",
               "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div")


def _packets() -> frozenset[Any]:
    return frozenset(packet for packet in (getattr(torch.ops.aten, n, None) for n in _REDUCTIONS)
                     if packet is not None)


def reduction_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a reduction computes in: its `dtype` argument, else its first floating
    tensor argument's."""
    wanted = kwargs.get("dtype")
    if isinstance(wanted, torch.dtype):
        return wanted
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg.dtype
    return None


def narrower(a: torch.dtype | None, b: torch.dtype) -> torch.dtype:
    """The narrower of two floating dtypes (by bits); the first on a tie."""
    return b if a is None or b.itemsize < a.itemsize else a


class ReductionProbe(TorchDispatchMode):
    """Records, per layer index, the narrowest dtype a reduction dispatched inside its
    forward computed in. Costs one Python call per op while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.reductions = _packets()
        self.inside: list[int] = []  # the probed layers whose forward is under way
        self.seen: dict[int, torch.dtype | None] = {}  # probed layer -> narrowest reduction

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.inside and func.overloadpacket in self.reductions:
            dtype = reduction_dtype(args, kwargs)
            if dtype is not None:
                index = self.inside[-1]
                self.seen[index] = narrower(self.seen.get(index), dtype)
        return func(*args, **kwargs)

    def enter(self, index: int) -> None:
        if not self.inside:
            self.__enter__()
        self.inside.append(index)
        self.seen.setdefault(index, None)

    def leave(self, index: int) -> None:
        if self.inside and self.inside[-1] == index:
            self.inside.pop()
            if not self.inside:
                self.__exit__(None, None, None)


class ComputeDtypeCollector(Collector):
    """No step field: `attrs["reduces_in"]` in the layer table, for layers with no child
    module whose forward ran a reduction (probed on sampled steps, once per autocast
    state)."""

    name = "compute_dtype"

    def __init__(self) -> None:
        super().__init__()
        self._probe: ReductionProbe | None = None
        self._hooks = SampledHooks(self._register)
        self._probed: dict[tuple, set[int]] = {}  # autocast state -> layers probed under it
        self._state: tuple | None = None  # this forward's autocast state
        self._sampled = False

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._leaves = [layer for layer in watch.layers
                        if next(layer.module.children(), None) is None]

    def unbind(self) -> None:
        self._hooks.remove()
        self._finish()

    def on_next_step(self, step: int) -> None:
        self._sampled = self.watch.samples(step)
        self._hooks.want(False)

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        if not (self._sampled and training):
            return
        device = self.watch.device.type
        enabled = torch.is_autocast_enabled(device)
        self._state = (enabled, torch.get_autocast_dtype(device) if enabled else None)
        probed = self._probed.setdefault(self._state, set())
        if len(probed) >= len(self._leaves):  # every layer probed under this state
            self._todo = []
            return
        self._todo = [layer for layer in self._leaves if layer.index not in probed]
        if self._todo:
            self._probe = ReductionProbe()
            self._hooks.want(True)
            self._hooks.ensure()

    def on_forward_end(self, training: bool, output: Any) -> None:
        self._hooks.want(False)
        self._finish()

    def _register(self) -> list[Any]:
        handles = []
        for layer in self._todo:
            pre, post = self._hook_pair(layer.index)
            handles.append(layer.module.register_forward_pre_hook(pre))
            handles.append(layer.module.register_forward_hook(post, always_call=True))
        return handles

    def _hook_pair(self, index: int) -> tuple[Any, Any]:
        watch = self.watch

        def pre(module: torch.nn.Module, args: tuple) -> None:
            if compiling():
                return
            try:
                if watch.in_training_forward and self._probe is not None:
                    self._probe.enter(index)
            except Exception as exc:  # noqa: BLE001
                errors.report("compute_dtype.pre", exc)

        def post(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if compiling():
                return
            try:
                if self._probe is not None:
                    self._probe.leave(index)
            except Exception as exc:  # noqa: BLE001
                errors.report("compute_dtype.post", exc)
        return pre, post

    def _finish(self) -> None:
        """Leave the probe if a forward raised inside a layer, then put what it saw into the
        layer table (re-registering the run when a layer's entry narrowed)."""
        probe, self._probe = self._probe, None
        if probe is None:
            return
        while probe.inside:
            probe.leave(probe.inside[-1])
        # every layer this forward could probe counts as probed, run or not: a layer that
        # never runs (an unused head) would otherwise keep the probe on every sampled step
        self._probed[self._state].update(layer.index for layer in self._todo)
        changed = False
        for index, dtype in probe.seen.items():
            if dtype is None:
                continue
            attrs = self.watch.layers[index].attrs
            kept = attrs.get("reduces_in")
            name = dtype_name(dtype)
            if kept is None or (name != kept and dtype.itemsize < getattr(torch, kept).itemsize):
                attrs["reduces_in"] = name
                changed = True
        if changed:
            self.watch.on_run_change()
