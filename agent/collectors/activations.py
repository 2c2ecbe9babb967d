"""Per-layer forward statistics: a non-finite flag, and on sampled steps the abs-max,
dtype and time of each layer's output; the layers' forward execution order.

On the CPU (`watch.host_reduce`, one rank, `check_outputs="flagged"`, the default) an
unsampled step registers no layer hook and reads no output: its training forwards'
inputs are held and, when the loss comes back inf/NaN, replayed to name the first layer
whose output held inf/NaN (forward_search.py; docs/agent.md, "Cheap by design"). On an
accelerator the same holds under a GradScaler, whose skip is the flag; without one, an
unsampled step's outputs are held until their backward and checked by a kernel that reads
the loss's flag first (flagged_checks.py), and a sampled step's outputs are held to the
forward's end and reduced by one `_foreach_norm(ord=inf)` per dtype. Outputs only the
agent would keep alive are held within `hold_mb`; past it, and for an output changed in
place before its check, the call takes its own `aminmax` as below.
Otherwise every layer has a forward post hook on every training step. A hook call does
one device op, `aminmax` of the layer's output (NaN and inf propagate; on the CPU with
`check_outputs="every_step"`, between samples, a sum: see below), and appends the call
to a list. At close, every step: the position
of the first call whose output held inf/NaN (in execution order, so the first offender
of that exact step) is reduced into one slot with a few device ops. On a sampled step
(every `sample_every` steps, and every step through `watch.anomaly_until`) the layers
also get a pre hook (time, token count) and the abs-max of every layer is reduced into
the buffer with about a dozen device ops whatever the number of layers or calls (grouped
by output dtype, a layer called several times keeps its largest value). On the CPU
(`watch.host_reduce`) both reductions are left to the worker, which reads the (min,
max) pairs themselves, and on unsampled steps a bf16 or float32 output is checked by its
sum instead, read in the hook, and only outputs that held inf/NaN are recorded (see
finite_checks.py: which outputs need no sum of their own). The dtype each layer computed
in and its forward time are worked out from the calls on the worker thread.
Does not synchronise the device.

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
from ampwatch.agent.collectors.base import Collector, SampledHooks
from ampwatch.agent.collectors.finite_checks import (
    FINITE_PRESERVING,
    SUM_CHECKED,
    Call,
    HostChecks,
    first_float_tensor,
    first_nonfinite_call,
)
from ampwatch.agent.collectors.forward_search import (
    HeldForward,
    first_bad_output,
    hold,
    loss_is_bad,
)
from ampwatch.agent.compiled import unwrap
from ampwatch.agent.layers import dtype_name
from ampwatch.wire import encode_float_array

compiling = torch.compiler.is_compiling  # traced hooks return at once: no graph break

def largest(*values: float) -> float:
    """max() that propagates NaN (the builtin's result depends on argument order)."""
    return math.nan if any(v != v for v in values) else max(values)


NO_CALL = 1 << 40  # the first-non-finite slot when every output was finite


class AbsMaxPlan:
    """How the calls of one step pattern reduce on the device: the (min, max) pairs are
    stacked per output dtype (a stack of mixed dtypes is ~5x slower); the first call
    with inf/NaN is the smallest call position among the non-finite pairs (four ops per
    dtype and three more); for the abs-max, one gather through a (layer x call) index
    matrix padded with a zero lets `amax` keep each layer's largest call. NaN propagates
    through every op. Built once per pattern, on the host."""

    def __init__(self, pattern: tuple[tuple[int, torch.dtype | None], ...], n_layers: int,
                 device: torch.device) -> None:
        groups: dict[torch.dtype, list[int]] = {}
        for position, (_, dtype) in enumerate(pattern):
            if dtype is not None:  # None: a call without statistics
                groups.setdefault(dtype, []).append(position)
        self.groups = list(groups.values())  # call positions per dtype, in concat order
        order = [p for positions in self.groups for p in positions]
        self.empty = not order
        if self.empty:
            return
        self.positions = [torch.tensor(positions, dtype=torch.float64, device=device)
                          for positions in self.groups]
        self.no_call = torch.full((1,), float(NO_CALL), dtype=torch.float64, device=device)
        rows: dict[int, list[int]] = {}
        for row, position in enumerate(order):
            rows.setdefault(pattern[position][0], []).append(row)
        width = max(len(r) for r in rows.values())
        pad = len(order)  # index of the appended zero
        matrix = [rows.get(layer, []) + [pad] * (width - len(rows.get(layer, [])))
                  for layer in range(n_layers)]
        self.index = torch.tensor(matrix, dtype=torch.long, device=device)
        self.single = width == 1  # each layer called once: a plain gather
        if self.single:
            self.index = self.index.reshape(-1)
        self.zero = torch.zeros(1, dtype=pattern[order[0]][1], device=device)

    def stack(self, calls: list[Call]) -> list[torch.Tensor]:
        """The (min, max) pairs of each dtype group, as (calls, 2) tensors."""
        return [torch.stack([x for p in positions for x in calls[p][2]]).view(-1, 2)
                for positions in self.groups]

    def first_nonfinite(self, pairs: list[torch.Tensor], out: torch.Tensor) -> None:
        """The position of the first call with inf/NaN into `out` (NO_CALL if none)."""
        if self.empty:
            out.fill_(float(NO_CALL))
            return
        firsts = [torch.where(group.isfinite().all(dim=1), NO_CALL, positions)
                  for group, positions in zip(pairs, self.positions, strict=True)]
        torch.amin(torch.cat([*firsts, self.no_call]), dim=0, keepdim=True, out=out)

    def reduce(self, pairs: list[torch.Tensor], out: torch.Tensor) -> None:
        if self.empty:
            return
        parts = [group.abs().amax(dim=1) for group in pairs]
        values = torch.cat([*parts, self.zero])  # cat promotes to the widest dtype
        values = values[self.index] if self.single else values[self.index].amax(dim=1)
        out.copy_(values)


class ActivationCollector(Collector):
    """`forward_nonfinite`, `first_nonfinite_layer` on every step (null when no training
    forward ran); `activations.absmax`, `.dtype`, `.time_ms` on sampled steps."""

    name = "activations"

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.slots = n_layers + 1  # abs-max per layer, then the first non-finite call
        self.order: list[int] = []
        self._hooks: list[Any] = []  # post hooks: every step
        self._sampled = False  # whether this step's forward is sampled (pre hooks are on)
        self._host_checks = False  # an unsampled step on the CPU: the hooks' fast path
        self._host = HostChecks()  # the fast path's verdicts
        self._flagged = False  # CPU, check_outputs="flagged": the search runs on bad losses
        self._search = False  # this step is unsampled and flagged: hold, search if bad
        self._held: list[HeldForward] = []  # this step's training forwards, not yet judged
        self._searched = False  # this step's forwards were searched (replayed)
        # an accelerator without a scaler's skip to go by: outputs held until their
        # backward begins, then checked by a kernel that reads the loss's flag first
        self._checks: flagged_checks.FlaggedChecks | None = None
        self._hold = False  # this step is unsampled and has flagged checks: hold outputs
        self._holding = False  # ... and this forward records a graph (a backward follows)
        # an accelerator's sampled step: outputs held to the forward's end, then their
        # abs-max in one _foreach_norm(ord=inf) launch per dtype (NaN and -inf kept)
        self._fuse = False
        self._fusing = False  # this forward's outputs are held for that
        self._held_outputs: list[tuple[int, int, torch.Tensor, int]] = []  # (call, layer,
        # output, its version when produced)
        self._in_place: set[int] = set()  # layers whose output changed before its check
        self._alone: set[int] = set()  # layers whose held output only the agent kept alive
        self._alone_bytes = 0  # what such outputs hold since the last check
        self._budget = 0  # bytes they may hold (bind: hold_mb)
        self._pre_hooks = SampledHooks(self._register_pre_hooks)  # sampled steps only
        self._plans: dict[tuple[tuple[int, torch.dtype | None], ...], AbsMaxPlan] = {}
        self._calls: list[Call] = []
        self._starts: dict[int, Any] = {}  # the hooks hold these two dicts: kept, cleared
        self._tokens: dict[int, int] = {}
        self._last_tokens: dict[int, int] = {}  # what close() saw last: unchanged is skipped
        self._last_pattern: tuple[tuple[int, torch.dtype | None], ...] | None = None

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        self._absmax_slots = self.view.narrow(0, 0, self.n_layers)
        self._first_slot = self.view.narrow(0, self.n_layers, 1)
        self._pre_by_layer = [(layer.module, self._pre(layer.index)) for layer in watch.layers]
        self._post_by_layer = [(layer.module, self._post(layer.index))
                               for layer in watch.layers]
        self._layer_modules = [(layer.index, layer.module) for layer in watch.layers]
        # not over several ranks: replaying one rank's forward alone could enter a collective
        # (DDP's buffer broadcast, FSDP's all-gather) the other ranks never join. On an
        # accelerator the replay's flag is a GradScaler's skip (a host fact once its step()
        # has run); without one, the outputs are held and checked by flagged_checks.py
        flagged = getattr(watch.settings, "check_outputs", "flagged") == "flagged"
        self._flagged = (watch.parallelism is None
                         and (watch.host_reduce or watch.scaler_enabled) and flagged)
        # flagged: the post hooks too exist on sampled steps only (a healthy step runs none)
        self._post_hooks = SampledHooks(self._register_post_hooks)
        if not self._flagged:
            self._hooks = self._register_post_hooks()
            if flagged and not watch.host_reduce:
                self._use_flagged_checks()
        self._fuse = not watch.host_reduce
        if self._fuse:  # what held outputs may keep alive that autograd does not
            hold_mb = getattr(watch.settings, "hold_mb", None)
            self._budget = (flagged_checks.default_budget(watch.device) if hold_mb is None
                            else int(hold_mb * (1 << 20)))

    def unbind(self) -> None:
        self._pre_hooks.remove()
        self._post_hooks.remove()
        self._held = []
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def sampling(self) -> bool:
        return self._sampled

    def on_next_step(self, step: int) -> None:
        sample = self.watch.samples(step)
        self._host_checks = self.watch.host_reduce and not sample and not self._flagged
        self._search = self._flagged and not sample
        self._hold = self._checks is not None and not sample
        if sample != self._sampled:
            self._sampled = sample
            self._pre_hooks.want(sample)
            if self._flagged:
                self._post_hooks.want(sample)

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        self._pre_hooks.ensure()
        self._post_hooks.ensure()
        # under no_grad no backward follows, and holding would keep alive outputs the
        # forward frees as it goes: those are checked as produced
        self._holding = self._hold and torch.is_grad_enabled()
        self._fusing = self._sampled and self._fuse
        if self._search and training:
            self._held.append(hold(self._replayable(), args, kwargs, self.watch.device))

    def on_backward_begin(self, loss: torch.Tensor | None) -> None:
        # the CPU's flag: the loss, a host value (an accelerator's would need a sync)
        if self.watch.host_reduce:
            held, self._held = self._held, []
            if held and loss_is_bad(loss):
                self._search_held(held)
        elif self._held_outputs:
            self._check_held_outputs(loss)

    def _replayable(self) -> torch.nn.Module:
        """The module this forward entered by (a compiled one's eager module)."""
        owner = self.watch.forward_owner
        return self.watch.inner if owner is None else unwrap(owner)

    def _check_held_outputs(self, loss: torch.Tensor | None) -> None:
        """Launch the flagged check of each output held since the last backward (no read:
        a healthy step's kernels read the flag and exit)."""
        checks = self._checks
        try:
            checks.check(checks.flag(loss), self._take_held())
        except Exception as exc:  # noqa: BLE001 (a Triton that cannot compile for this GPU)
            self._checks = None  # from the next step on every output is checked as made
            self._hold = self._holding = False
            errors.report("activations.flagged_checks", exc)

    def _search_held(self, held: list[HeldForward]) -> None:
        """Replay the step's held forwards, in order, up to the first with a bad output."""
        self._searched = True
        watch = self.watch
        suspended, watch.suspended = watch.suspended, True  # the replay is no forward
        try:
            for forward in held:
                call = first_bad_output(forward.module, forward, self._layer_modules,
                                        on_device=not watch.host_reduce)
                if call is not None:
                    self._calls.append(call)
                    break
        finally:
            watch.suspended = suspended

    def on_forward_end(self, training: bool, output: Any) -> None:
        self._host.end_forward()
        if self._fusing:
            self._fusing = False
            if self._held_outputs:
                self._fuse_held()

    def _fuse_held(self) -> None:
        """A sampled forward's held outputs: each call's abs-max as its (min, max) pair
        (the same 0-d tensor twice: finite exactly when the output was, the abs-max
        either way), in one `_foreach_norm` per dtype."""
        groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for position, output in self._take_held():
            groups.setdefault(output.dtype, []).append((position, output))
        calls = self._calls
        for items in groups.values():
            norms = torch._foreach_norm([output.detach() for _, output in items], math.inf)
            for (position, _), norm in zip(items, norms, strict=True):
                index, dtype, _, start, end = calls[position]
                calls[position] = (index, dtype, (norm, norm), start, end)

    def _take_held(self) -> list[tuple[int, torch.Tensor]]:
        """The held outputs as (call position, output), released, and what each says of
        its layer: changed in place since it was produced (from the next step on checked
        as produced; this one as it is now), and whether only the agent kept it alive
        (then held within the budget only)."""
        held, self._held_outputs = self._held_outputs, []
        self._alone_bytes = 0
        for _, index, output, version in held:
            if output._version != version:
                self._in_place.add(index)
            if flagged_checks.kept_alone(output):
                self._alone.add(index)
            else:
                self._alone.discard(index)
        return [(position, output) for position, _, output, _ in held]

    def on_step_end(self, step: int, stepped: bool) -> None:
        # an accelerator's flag: the GradScaler skipped the step (it read found_inf itself),
        # so the weights are still those the held forwards ran with. A fused optimizer
        # takes found_inf on the device and always "steps": no host fact, so its outputs
        # are checked every step from here on
        held, self._held = self._held, []
        if held and not self.watch.host_reduce:
            if getattr(self.watch.optimizer, "_step_supports_amp_scaling", False):
                self._unflag()
            elif not stepped:
                self._search_held(held)
        if not stepped:
            self.watch.note_anomaly(step)

    def _unflag(self) -> None:
        """No skip to go by: hold the outputs for the flagged checks, or where the kernel
        cannot run check every output on every step (no flag is read without a sync)."""
        self._flagged = self._search = False
        self._post_hooks.want(False)
        if not self._hooks:
            self._hooks = self._register_post_hooks()
        self._use_flagged_checks()

    def _use_flagged_checks(self) -> None:
        device = self.watch.device
        if self._checks is None and flagged_checks.available(device):
            self._checks = flagged_checks.FlaggedChecks(device, NO_CALL)

    def _register_pre_hooks(self) -> list[Any]:
        return [module.register_forward_pre_hook(pre) for module, pre in self._pre_by_layer]

    def _register_post_hooks(self) -> list[Any]:
        return [module.register_forward_hook(post) for module, post in self._post_by_layer]

    # the layer hooks run once or twice per layer per step: the error boundary is inlined, not a
    # wrapper, and they do as little as possible (the rest happens at close or on the worker)
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
        mark = watch.clock.mark
        starts = self._starts
        aminmax = torch.aminmax
        preserves_finite = type(watch.layers[index].module) in FINITE_PRESERVING

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if compiling():
                return
            try:
                if not watch.in_training_forward:
                    return
                tensor = output if type(output) is torch.Tensor else first_float_tensor(output)
                if self._host_checks and tensor is not None:
                    dtype = tensor.dtype  # SUM_CHECKED holds floating dtypes only
                    # finite_check reads a value: CPU tensors only, so no device to wait for
                    if dtype in SUM_CHECKED and tensor.is_cpu:
                        try:
                            version = tensor._version
                        except RuntimeError:  # an inference tensor: no version counter
                            version = None
                        if version is not None:
                            self._host.check(index, args, tensor, version, dtype,
                                             preserves_finite, self._calls)
                            return
                start = starts.pop(index, None) if starts else None
                end = None if start is None else mark()
                if ((self._holding or self._fusing) and tensor is not None
                        and index not in self._in_place and tensor.is_floating_point()
                        and tensor.numel() and (self._fusing or (
                            tensor.is_contiguous() and flagged_checks.readable(tensor.dtype)))):
                    try:
                        version = tensor._version
                    except RuntimeError:  # an inference tensor: no version counter
                        version = None
                    if version is not None and self._within_budget(index, tensor):
                        # held for the flagged check as its backward begins, or for the
                        # sampled abs-max as the forward ends
                        self._held_outputs.append((len(self._calls), index, tensor, version))
                        self._calls.append((index, tensor.dtype, None, start, end))
                        return
                if tensor is None or not tensor.is_floating_point():
                    self._calls.append((index, None, None, start, end))
                elif tensor.numel() == 0:
                    self._calls.append((index, tensor.dtype, None, start, end))
                else:
                    self._calls.append((index, tensor.dtype, aminmax(tensor.detach()),
                                        start, end))
            except Exception as exc:  # noqa: BLE001
                errors.report("activations.post", exc)
        return hook

    def _within_budget(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether holding `tensor` (layer `index`'s output) stays within the budget: an
        output autograd kept anyway costs nothing; one only the agent kept (last time)
        counts its bytes."""
        if index not in self._alone:
            return True
        size = tensor.numel() * tensor.element_size()
        if self._alone_bytes + size > self._budget:
            return False
        self._alone_bytes += size
        return True

    def seal(self) -> Any:
        host = self._host
        host.end_forward()
        sealed = (self.sampling, self._calls, dict(self._tokens) if self._tokens else None,
                  host.observed or self._searched, self._searched)
        self._calls = []
        host.observed = self._searched = False
        self._held = []
        # outputs of a forward no backward followed: checked as if its loss were bad (they
        # are read; a rare case)
        if self._held_outputs and self._checks is not None:
            self._check_held_outputs(None)
        self._held_outputs = []
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
            if plan is None:
                plan = self._plans[pattern] = AbsMaxPlan(pattern, self.n_layers,
                                                         self.watch.device)
            pairs = plan.stack(calls) if not plan.empty else []
            plan.first_nonfinite(pairs, self._first_slot)
            if self._checks is not None:
                self._checks.take_into(self._first_slot)
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
