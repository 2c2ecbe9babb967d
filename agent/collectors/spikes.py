"""The signals that precede bf16 loss spikes, per layer, on sampled steps: the update-to-weight
ratio, the share of the update rounded away in the parameter's dtype, Adam's eps-dominated
and zero second-moment shares (agent/update_stats.py), the largest attention logit of each
attention layer, and the output logits' largest magnitude and log-partition
(agent/attention_logits.py).

Sampled with the activation statistics (every `sample_every` steps and through the anomaly
window). On a sampled step, as its first forward begins: a forward pre-hook on every
`nn.MultiheadAttention`, a pre and post hook on every layer that may call
`scaled_dot_product_attention` (those with children, and leaf modules from outside
`torch.nn`) so a call is credited to the innermost one running, a wrapper around
`torch.nn.functional.scaled_dot_product_attention` and, once transformers is imported,
around the attention function its modules pick (agent/attention_calls.py: credited to the
module that passes itself to it), and a forward hook on the output layer
(the last layer in forward order with a matrix weight). All of them come off as the next
unsampled step is set up. Only training forwards are measured; a layer called several
times keeps its largest logit, the output layer its first call. The optimizer's update is
rebuilt from its state as the step ends, on sampled steps that are also a multiple of
`max(sample_every, UPDATE_EVERY_MIN)` (every 20th step by default). Nothing synchronises
the device: the values reach the step buffer at close and the host a step later, on the
worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ampwatch.agent import distributed, errors, patches
from ampwatch.agent.attention_calls import SDPA, interface_patch
from ampwatch.agent.attention_logits import (
    mha_inputs,
    mha_max_logit,
    output_stats,
    scores_dtype,
    sdpa_max_logit,
)
from ampwatch.agent.collectors.activations import first_float_tensor
from ampwatch.agent.collectors.base import Collector, SampledHooks, device_tensor
from ampwatch.agent.collectors.compute_dtype import narrower
from ampwatch.agent.layers import dtype_name
from ampwatch.agent.update_stats import N_SUMS, SUMS, kind_of, param_sums
from ampwatch.wire import encode_float_array

_SUM = {name: i for i, name in enumerate(SUMS)}
_compiling = torch.compiler.is_compiling


class _PatchHandle:
    """A GlobalPatch listener as a hook handle (SampledHooks removes handles)."""

    def __init__(self, patch: patches.GlobalPatch, before: Any = None,
                 replace: Any = None) -> None:
        self._patch, self._token = patch, patch.add(before, replace=replace)

    def remove(self) -> None:
        self._patch.remove(self._token)


def _may_call_sdpa(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return False  # measured from its inputs by its own pre-hook
    has_children = next(module.children(), None) is not None
    return has_children or not type(module).__module__.startswith("torch.nn")


class SpikeCollector(Collector):
    """`spikes.{update_ratio, update_lost, adam_eps_share, adam_v_zero_share,
    attn_max_logit, logit_absmax, logit_lse}`, per layer, on sampled steps."""

    name = "spikes"
    # steps between update statistics, at the least: rebuilding the update reads every
    # parameter's state (on a CPU about 2/3 of the optimizer step itself), while the
    # logits cost a few small ops; an update ratio is a slow trend until it jumps
    UPDATE_EVERY_MIN = 20

    def __init__(self, layers: list[Any]) -> None:
        super().__init__()
        self.n_layers = len(layers)
        # layers that own parameters get a row of update sums; a tied parameter counts in
        # the first layer holding it
        self.rows = [layer.index for layer in layers if any(
            id(p) not in layer.tied for p in layer.params)]
        self._row_of_param = {id(p): row for row, index in enumerate(self.rows)
                              for p in layers[index].params if id(p) not in layers[index].tied}
        self.slots = N_SUMS * len(self.rows) + self.n_layers + 2
        self._sampled = False
        self._hooks = SampledHooks(self._register_hooks)
        self._stack: list[int] = []  # the layers (that may call SDPA) now running forward
        self._layer_of = {id(layer.module): layer.index for layer in layers}
        self._in_interface = 0  # inside a transformers attention function (it may call SDPA)
        self._attn: dict[int, torch.Tensor] = {}
        self._head: tuple[int, torch.Tensor] | None = None
        self._logits_in: dict[int, torch.dtype] = {}  # this forward's, narrowest per layer
        self._sums: tuple[list[int], torch.Tensor] | None = None
        self._kind: str | None = None
        self._unsupported_named = False
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def bind(self, watch: Any) -> None:
        super().bind(watch)
        n_sums = N_SUMS * len(self.rows)
        self._sum_slots = self.view.narrow(0, 0, n_sums).view(len(self.rows), N_SUMS)
        self._attn_slots = self.view.narrow(0, n_sums, self.n_layers)
        self._head_slots = self.view.narrow(0, n_sums + self.n_layers, 2)
        self._zeros = torch.zeros(len(self.rows), N_SUMS, dtype=watch.buffer.dtype,
                                  device=watch.device)

    def unbind(self) -> None:
        self._hooks.remove()

    def on_next_step(self, step: int) -> None:
        sample = self.watch.samples(step)
        if sample != self._sampled:
            self._sampled = sample
            self._hooks.want(sample)

    def on_forward_begin(self, training: bool, args: tuple, kwargs: dict) -> None:
        if self._sampled:
            self._stack.clear()  # a forward that raised left its layers on it
            self._hooks.ensure()

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self) -> list[Any]:
        handles: list[Any] = [_PatchHandle(SDPA, self._on_sdpa)]
        interface = interface_patch()
        if interface is not None:
            handles.append(_PatchHandle(interface, replace=self._pick_interface))
        for layer in self.watch.layers:
            module = layer.module
            if isinstance(module, nn.MultiheadAttention):
                handles.append(module.register_forward_pre_hook(
                    self._mha(layer.index), with_kwargs=True))
            elif _may_call_sdpa(module):
                handles.append(module.register_forward_pre_hook(self._enter(layer.index)))
                handles.append(module.register_forward_hook(self._leave, always_call=True))
        head = self._head_layer()
        if head is not None:
            handles.append(head.module.register_forward_hook(self._output(head.index)))
        return handles

    def _head_layer(self) -> Any:
        """The output layer: the last in forward order (once known) with a matrix weight."""
        candidates = [layer for layer in self.watch.layers
                      if isinstance(getattr(layer.module, "weight", None), torch.Tensor)
                      and layer.module.weight.dim() == 2
                      and not isinstance(layer.module, nn.Embedding)]
        ordered = [layer for layer in candidates if layer.forward_index is not None]
        if ordered:
            return max(ordered, key=lambda layer: layer.forward_index)
        return candidates[-1] if candidates else None

    def _note_logit(self, index: int, value: torch.Tensor | None, dtype: torch.dtype) -> None:
        if value is None:
            return
        kept = self._attn.get(index)
        self._attn[index] = value if kept is None else torch.maximum(kept, value)
        self._logits_in[index] = narrower(self._logits_in.get(index), dtype)

    def on_forward_end(self, training: bool, output: Any) -> None:
        """The dtype each measured layer's logits were computed in, into its layer table
        entry (`attrs["logits_in"]`, narrowed only; the run is re-registered when one
        narrowed): what the server judges their size by."""
        seen, self._logits_in = self._logits_in, {}
        changed = False
        for index, dtype in seen.items():
            attrs = self.watch.layers[index].attrs
            kept = attrs.get("logits_in")
            narrowest = narrower(None if kept is None else getattr(torch, kept), dtype)
            if dtype_name(narrowest) != kept:
                attrs["logits_in"] = dtype_name(narrowest)
                changed = True
        if changed:
            self.watch.on_run_change()

    def _enter(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            if not _compiling():
                self._stack.append(index)
        return hook

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not _compiling() and self._stack:
            self._stack.pop()

    def _mha(self, index: int) -> Any:
        watch = self.watch

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if _compiling() or not watch.in_training_forward:
                return
            try:
                inputs = mha_inputs(args, kwargs)
                if inputs is not None:
                    with torch.no_grad():
                        self._note_logit(index, mha_max_logit(module, *inputs),
                                         scores_dtype(*inputs))
            except Exception as exc:  # noqa: BLE001
                errors.report("spikes.mha", exc)
        return hook

    def _pick_interface(self, original: Any, args: tuple, kwargs: dict) -> Any:
        """transformers' `get_interface`: the attention function it returns, wrapped so that
        its call is measured and credited to the module passing itself first."""
        function = original(*args, **kwargs)
        if _compiling() or not self.watch.in_training_forward or not callable(function):
            return function

        def attention(module: nn.Module, query: Any, key: Any, *rest: Any, **kw: Any) -> Any:
            index = self._layer_of.get(id(module))
            if index is None and self._stack:
                index = self._stack[-1]
            if (index is not None and isinstance(query, torch.Tensor)
                    and isinstance(key, torch.Tensor)):
                try:
                    with torch.no_grad():
                        self._note_logit(index, sdpa_max_logit(query, key, kw.get("scaling")),
                                         scores_dtype(query, key))
                except Exception as exc:  # noqa: BLE001
                    errors.report("spikes.attention", exc)
            self._in_interface += 1
            try:
                return function(module, query, key, *rest, **kw)
            finally:
                self._in_interface -= 1
        return attention

    def _on_sdpa(self, args: tuple, kwargs: dict) -> None:
        if (_compiling() or not self.watch.in_training_forward or not self._stack
                or self._in_interface):
            return
        query = args[0] if args else kwargs.get("query")
        key = args[1] if len(args) > 1 else kwargs.get("key")
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
            with torch.no_grad():
                self._note_logit(self._stack[-1],
                                 sdpa_max_logit(query, key, kwargs.get("scale")),
                                 scores_dtype(query, key))

    def _output(self, index: int) -> Any:
        watch = self.watch

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if _compiling() or not watch.in_training_forward or self._head is not None:
                return
            try:
                logits = first_float_tensor(output)
                with torch.no_grad():
                    stats = output_stats(logits)
                if stats is not None:
                    self._head = (index, stats)
                    self._logits_in[index] = logits.dtype
            except Exception as exc:  # noqa: BLE001
                errors.report("spikes.output", exc)
        return hook

    # ------------------------------------------------------------------ the update
    def on_step_end(self, step: int, stepped: bool) -> None:
        optimizer = self.watch.optimizer
        every = max(self.watch.settings.sample_every, self.UPDATE_EVERY_MIN)
        if not (self._sampled and stepped) or optimizer is None or step % every:
            return
        kind = kind_of(optimizer)
        if kind is None:
            if not self._unsupported_named:
                self._unsupported_named = True
                self.watch.note_unsupported(
                    f"update_ratio ({type(optimizer).__name__})",
                    [self.watch.layers[i].name for i in self.rows])
            return
        local = distributed.local if self.watch.parallelism is not None else (lambda t: t)
        with torch.no_grad():
            self._sums = param_sums(optimizer, kind, self._row_of_param, local)
        self._kind = kind

    def seal(self) -> Any:
        if not self._sampled:  # nothing was measured: the hooks are off
            return None
        sealed = (self._sums, self._kind, self._attn, self._head)
        self._sums, self._kind, self._attn, self._head = None, None, {}, None
        return sealed

    def close(self, sealed: Any) -> Any:
        if sealed is None:
            return None
        sums, kind, attn, head = sealed
        if sums is None and not attn and head is None:
            return None
        measured_rows = None
        if sums is not None:
            rows, values = sums
            index = self._index(rows, values.device)
            torch.index_add(self._zeros, 0, index, values.to(self._zeros.dtype),
                            out=self._sum_slots)
            measured_rows = sorted(set(rows))
        attn_layers = sorted(attn)
        if attn_layers:
            index = self._index(attn_layers, self.watch.device)
            values = torch.stack([attn[i] for i in attn_layers]).to(self._attn_slots.dtype)
            self._attn_slots.index_copy_(0, index, values)
        if head is not None:
            self._head_slots.copy_(head[1])
        return measured_rows, kind, attn_layers, None if head is None else head[0]

    def _index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """`rows` as an index tensor on `device`, made once per distinct list: a CUDA one is
        copied from pinned memory without waiting for the device (a pageable copy would)."""
        key = tuple(rows)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= 64:  # the sampled layers changed many times: start over
                self._indices.clear()
            index = self._indices[key] = device_tensor(rows, torch.long, device)
        return index

    # ------------------------------------------------------------------ worker
    def read(self, host: np.ndarray, meta: Any, record: dict[str, Any]) -> None:
        if meta is None:
            return
        rows, kind, attn_layers, head = meta
        n, n_sums = self.n_layers, N_SUMS * len(self.rows)
        out: dict[str, list] = {}
        if rows:
            sums = host[:n_sums].reshape(len(self.rows), N_SUMS)[rows]
            layers = np.array([self.rows[r] for r in rows])
            column = {name: sums[:, i] for name, i in _SUM.items()}
            with np.errstate(divide="ignore", invalid="ignore"):
                out["update_ratio"] = _per_layer(
                    n, layers, np.sqrt(column["update_sq"] / column["weight_sq"]),
                    column["weight_sq"] > 0)
                out["update_lost"] = _per_layer(n, layers, column["lost"] / column["moved"],
                                                column["moved"] > 0)
                if kind == "adam":
                    graded = column["grad_nonzero"] > 0
                    out["adam_eps_share"] = _per_layer(
                        n, layers, column["eps_dominated"] / column["grad_nonzero"], graded)
                    out["adam_v_zero_share"] = _per_layer(
                        n, layers, column["v_zero"] / column["grad_nonzero"], graded)
        if attn_layers:
            out["attn_max_logit"] = _per_layer(n, np.array(attn_layers),
                                               host[n_sums: n_sums + n][attn_layers],
                                               np.ones(len(attn_layers), dtype=bool))
        if head is not None:
            for i, name in enumerate(("logit_absmax", "logit_lse")):
                out[name] = _per_layer(n, np.array([head]),
                                       host[n_sums + n + i: n_sums + n + i + 1],
                                       np.ones(1, dtype=bool))
        out = {name: vector for name, vector in out.items() if vector is not None}
        if out:
            record["spikes"] = out


def _per_layer(n: int, layers: np.ndarray, values: np.ndarray, valid: np.ndarray) -> list | None:
    """An n-long wire vector holding `values` at `layers` where `valid`; None if none is."""
    if not valid.any():
        return None
    full = np.zeros(n)
    missing = np.ones(n, dtype=bool)
    full[layers[valid]] = values[valid]
    missing[layers[valid]] = False
    return encode_float_array(full, missing=missing)
