"""Per-layer forward statistics: a non-finite flag, and on sampled steps the abs-max,
dtype and time of each layer's output; the layers' forward execution order.

Two parts. The first bad layer, on every step: one way of finding it, chosen as the
collector is bound (first_bad_layer.py lists the four: every output on the device,
every output on the host, a replay of a flagged step's forward, held outputs checked by
a flagged kernel), switched only where the way itself cannot go on (a kernel that fails
to compile, a fused optimizer under a scaler, which leaves no skip to replay on). On the
CPU (`watch.host_reduce`, one rank, `check_outputs="flagged"`, the default) an
unsampled step registers no layer hook and reads no output (docs/agent.md, "Cheap by
design").

The sampled statistics, every `sample_every` steps and through `watch.anomaly_until`:
the layers get a pre hook (time, token count) and a post hook that takes each output's
(min, max), or on an accelerator holds it to the forward's end and reduces all of them
by one `_foreach_norm(ord=inf)` per dtype (held_outputs.py). At close the abs-max of
every layer is reduced into the buffer with about a dozen device ops whatever the number
of layers or calls (absmax_plan.py); on the CPU the worker reads the (min, max) pairs
themselves. The dtype each layer computed in and its forward time are worked out from
the calls on the worker thread. Does not synchronise the device.

The first sampled training forward gives the forward order, and each Linear-like layer's
token count (the rows of its GEMM, read from the input's shape on the host); a change
triggers a re-registration of the run's layer table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ampwatch.agent import errors
from ampwatch.agent.collectors import flagged_checks
from ampwatch.agent.collectors.absmax_plan import NO_CALL, AbsMaxPlans, largest
from ampwatch.agent.collectors.base import Collector, SampledHooks
from ampwatch.agent.collectors.finite_checks import (
    FINITE_PRESERVING,
    Call,
    EveryOutputOnHost,
    first_float_tensor,
    first_nonfinite_call,
)
from ampwatch.agent.collectors.first_bad_layer import (
    EveryOutputOnDevice,
    FirstBadLayer,
    record_minmax,
)
from ampwatch.agent.collectors.forward_search import ReplaySearch
from ampwatch.agent.collectors.held_outputs import HeldOutputChecks, HeldOutputs
from ampwatch.agent.layers import dtype_name
from ampwatch.wire import encode_float_array

__all__ = ["NO_CALL", "ActivationCollector"]

compiling = torch.compiler.is_compiling  # traced hooks return at once: no graph break


class ActivationCollector(Collector):
    """`forward_nonfinite`, `first_nonfinite_layer` on every step (null when no training
    forward ran); `activations.absmax`, `.dtype`, `.time_ms` on sampled steps."""

    name = "activations"

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = n_layers + 1  # abs-max per layer, then the first non-finite call
        self.order: list[int] = []
        self._way: FirstBadLayer | None = None  # how the first bad layer is found (bind)
        self._hooks: list[Any] = []  # post hooks on every step (the way wants them)
        self._sampled = False  # whether this step's forward is sampled (pre hooks are on)
        # an accelerator: outputs held for the sampled abs-max and the flagged kernel
        self._held: HeldOutputs | None = None
        self._fusing = False  # this forward's outputs are held for the sampled abs-max
        self._pre_hooks = SampledHooks(self._register_pre_hooks)  # sampled steps only
        self._post_hooks = SampledHooks(self._register_post_hooks)
        self._plans: AbsMaxPlans | None = None  # bind: the device's
        self._calls: list[Call] = []
        self._starts: dict[int, Any] = {}  # the hooks hold these two dicts: kept, cleared
        self._tokens: dict[int, int] = {}
        self._last_tokens: dict[int, int] = {}  # what close() saw last: unchanged is skipped
        self._last_pattern: tuple[tuple[int, torch.dtype | None], ...] | None = None

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._absmax_slots = self.view.narrow(0, 0, self.n_layers)
        self._first_slot = self.view.narrow(0, self.n_layers, 1)
        self._plans = AbsMaxPlans(self.n_layers, watch.device)
        self._pre_by_layer = [(layer.module, self._pre(layer.index)) for layer in watch.layers]
        self._post_by_layer = [(layer.module, self._post(layer.index))
                               for layer in watch.layers]
        if not watch.host_reduce:  # what held outputs may keep alive that autograd does not
            hold_mb = getattr(watch.settings, "hold_mb", None)
            self._held = HeldOutputs(flagged_checks.default_budget(watch.device)
                                     if hold_mb is None else int(hold_mb * (1 << 20)),
                                     watch.device)
        self._use(self._choose_way())

    def _choose_way(self) -> FirstBadLayer:
        """The cheapest way that can serve this run. A replay needs a host fact that says
        the step was bad without a sync: the CPU's loss, or a GradScaler's skip; and one
        rank (a replay of one rank alone could enter a collective the others never join)."""
        watch = self.watch
        flagged = getattr(watch.settings, "check_outputs", "flagged") == "flagged"
        if flagged and watch.parallelism is None and (watch.host_reduce or watch.scaler_enabled):
            layers = [(layer.index, layer.module) for layer in watch.layers]
            return ReplaySearch(watch, layers, no_skip=self._hold_outputs_instead)
        if watch.host_reduce:
            return EveryOutputOnHost(watch)
        return self._held_output_checks() if flagged else EveryOutputOnDevice(watch)

    def _held_output_checks(self) -> FirstBadLayer:
        """The flagged kernel over held outputs, or where it cannot run, every output."""
        watch = self.watch
        if self._held is None or not flagged_checks.available(watch.device):
            return EveryOutputOnDevice(watch)
        return HeldOutputChecks(watch, self._held,
                                flagged_checks.FlaggedChecks(watch.device, NO_CALL),
                                failed=self._check_every_output)

    def _hold_outputs_instead(self) -> None:
        """A replay with no skip to go by (a fused optimizer under a scaler)."""
        self._use(self._held_output_checks())

    def _check_every_output(self) -> None:
        """The flagged kernel cannot run here."""
        self._use(EveryOutputOnDevice(self.watch))

    def _use(self, way: FirstBadLayer) -> None:
        self._way = way
        if way.hooks_every_step and not self._hooks:
            self._post_hooks.want(False)
            self._hooks = self._register_post_hooks()

    def unbind(self) -> None:
        self._pre_hooks.remove()
        self._post_hooks.remove()
        if self._way is not None:
            self._way.unbind()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def sampling(self) -> bool:
        return self._sampled

    def on_next_step(self, step: int) -> None:
        sample = self.watch.samples(step)
        if sample != self._sampled:
            self._sampled = sample
            self._pre_hooks.want(sample)
            if not self._way.hooks_every_step:
                self._post_hooks.want(sample)

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        self._pre_hooks.ensure()
        self._post_hooks.ensure()
        self._fusing = self._sampled and self._held is not None
        self._way.forward_begin(self._sampled, training, args, kwargs)

    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        self._way.backward_begin(loss, self._calls)

    def on_forward_end(self, training: bool, output: Any) -> None:
        self._way.forward_end()
        if self._fusing:
            self._fusing = False
            if self._held.outputs:
                self._fuse_held()
            else:
                self._held.take()  # judges the outputs watched instead of held

    def _fuse_held(self) -> None:
        """A sampled forward's held outputs: each call's abs-max as its (min, max) pair
        (the same 0-d tensor twice: finite exactly when the output was, the abs-max
        either way), in one `_foreach_norm` per dtype."""
        groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for position, output in self._held.take():
            groups.setdefault(output.dtype, []).append((position, output))
        calls = self._calls
        for items in groups.values():
            norms = torch._foreach_norm([output.detach() for _, output in items], math.inf)
            for (position, _), norm in zip(items, norms, strict=True):
                index, dtype, _, start, end = calls[position]
                calls[position] = (index, dtype, (norm, norm), start, end)

    def on_step_end(self, step: int, stepped: bool) -> None:
        self._way.step_end(stepped, self._calls)
        if not stepped:
            self.watch.note_anomaly(step)

    def _register_pre_hooks(self) -> list[Any]:
        return [module.register_forward_pre_hook(pre) for module, pre in self._pre_by_layer]

    def _register_post_hooks(self) -> list[Any]:
        return [module.register_forward_hook(post) for module, post in self._post_by_layer]

    # the layer hooks run once or twice per layer per step: the error boundary is inlined,
    # not a wrapper, and they do as little as possible (the rest happens at close or on the
    # worker)
    def _pre(self, index: int) -> Any:
        watch = self.watch
        mark = watch.clock.mark
        starts, tokens = self._starts, self._tokens
        # a Linear-like layer's GEMM has one row per token: input.numel() / in_features
        in_features = watch.layers[index].attrs.get("in_features")
        counts_tokens = isinstance(in_features, int) and in_features > 0

        def hook(module: torch.nn.Module, args: tuple) -> None:
            if compiling():
                return
            try:
                if watch.in_training_forward:
                    starts[index] = mark()
                    if counts_tokens and args and isinstance(args[0], torch.Tensor):
                        tokens[index] = args[0].numel() // in_features
            except Exception as exc:  # noqa: BLE001
                errors.report("activations.pre", exc)
        return hook

    def _post(self, index: int) -> Any:
        watch = self.watch
        preserves_finite = type(watch.layers[index].module) in FINITE_PRESERVING

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if compiling():
                return
            try:
                if not watch.in_training_forward:
                    return
                tensor = output if type(output) is torch.Tensor else first_float_tensor(output)
                if self._sampled:
                    self._sample(index, tensor)
                else:
                    self._way.output(index, args, tensor, preserves_finite, self._calls)
            except Exception as exc:  # noqa: BLE001
                errors.report("activations.post", exc)
        return hook

    def _sample(self, index: int, tensor: torch.Tensor | None) -> None:
        """A sampled step's output: its call with the layer's time, and its (min, max) now,
        or on an accelerator held for the forward's end."""
        starts = self._starts
        start = starts.pop(index, None) if starts else None
        end = None if start is None else self.watch.clock.mark()
        if not (self._fusing and tensor is not None
                and self._held.hold(index, tensor, self._calls, start, end)):
            record_minmax(self._calls, index, tensor, start, end)

    def seal(self) -> Any:
        observed, searched = self._way.seal()
        sealed = (self.sampling, self._calls, dict(self._tokens) if self._tokens else None,
                  observed, searched)
        self._calls = []
        if self._held is not None:
            self._held.clear()
        self._starts.clear()
        self._tokens.clear()
        return sealed

    def close(self, sealed: Any) -> Any:
        sampled, calls, tokens, observed, searched = sealed
        if not calls and not observed:
            return None
        host_reduce = self.watch.host_reduce or searched  # a search's stats are host values
        if host_reduce and not sampled:  # the worker reads the calls; nothing to plan
            return sampled, calls, host_reduce
        # each call's layer and the dtype its statistics have (None: it has none)
        pattern = tuple((call[0], None if call[2] is None else call[1]) for call in calls)
        if sampled:
            self._note_order(pattern, calls, tokens or {})
        if not host_reduce:
            plan = self._plans.get(pattern)
            pairs = plan.stack(calls) if not plan.empty else []
            plan.first_nonfinite(pairs, self._first_slot)
            self._way.close(self._first_slot)
            if sampled:
                plan.reduce(pairs, self._absmax_slots)
        return sampled, calls, host_reduce

    def _note_order(self, pattern: tuple, calls: list[Call], tokens: dict[int, int]) -> None:
        """Forward order and token counts from a sampled step; a change re-registers."""
        changed = tokens != self._last_tokens and self._note_tokens(tokens)
        if pattern != self._last_pattern:  # the layers ran in another order or dtype
            self._last_pattern = pattern
            self.watch.fp16_outputs = any(dtype is torch.float16 for _, dtype in pattern)
            seen = list(dict.fromkeys(call[0] for call in calls))
            if seen and seen != self.order[: len(seen)] or len(seen) > len(self.order):
                self.order = seen
                for layer in self.watch.layers:
                    layer.forward_index = (seen.index(layer.index) if layer.index in seen
                                           else None)
                changed = True
        if changed:
            self.watch.on_run_change()

    def _note_tokens(self, tokens: dict[int, int]) -> bool:
        """Put token counts in the layer table: the first seen, replaced only by one that
        is not a multiple of 8 when the kept one is (so a misaligned count is reported
        once rather than re-registering the run for every sequence length)."""
        self._last_tokens = tokens
        changed = False
        for index, count in tokens.items():
            attrs = self.watch.layers[index].attrs
            kept = attrs.get("token_count")
            if kept is None or (count != kept and count % 8 and not kept % 8):
                attrs["token_count"] = count
                changed = True
        return changed

    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:  # no training forward in this step: nothing observed
            record["forward_nonfinite"] = None
            record["first_nonfinite_layer"] = None
            return
        sampled, calls, host_reduce = meta
        if host_reduce:
            first = first_nonfinite_call(calls)
        else:
            position = int(host[self.n_layers])
            first = None if position >= NO_CALL else position
            if position > NO_CALL:  # held for the flagged checks, and the loss was finite
                record["forward_nonfinite"] = None
                record["first_nonfinite_layer"] = None
                return
        record["forward_nonfinite"] = first is not None
        record["first_nonfinite_layer"] = None if first is None else calls[first][0]
        if not sampled:
            return
        n = self.n_layers
        elapsed = self.watch.clock.elapsed_ms
        ran = np.zeros(n, dtype=bool)
        dtypes: list[str | None] = [None] * n
        times: list[float | None] = [None] * n
        called: set[int] = set()
        absmax = np.zeros(n) if host_reduce else host[:n]
        for index, dtype, stats, start, end in calls:
            ran[index] |= stats is not None
            if host_reduce and stats is not None:
                absmax[index] = largest(absmax[index], -float(stats[0]), float(stats[1]))
            name = dtype_name(dtype)
            dtypes[index] = (name if index not in called or dtypes[index] == name
                             else "mixed")
            called.add(index)
            if start is not None:
                times[index] = (times[index] or 0.0) + elapsed(start, end)
        record["activations"] = {"absmax": encode_float_array(absmax, missing=~ran),
                                 "dtype": dtypes, "time_ms": times}
