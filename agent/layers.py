"""The model's layer table: which modules are layers, their parameters and dimensions.

A layer is a module that owns parameters itself, has no children, or is an attention
block: it names a head count, or its forward calls an attention function
(agent/attention_calls.py), as Llama's does with its head count in a config. The table
is built once at attach (host only).
A parameter held by several layers (a tied embedding and LM head) counts in the first
layer's `param_count` only; the later ones name it in `attrs["tied_to"]`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampwatch.agent.attention_calls import calls_attention
from ampwatch.agent.compiled import clean_name, is_compiled_wrapper

_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
_EMBED_ATTRS = ("embed_dim", "n_embd", "d_model", "hidden_size", "embed_size")
_SCALAR = (bool, int, float, str)


@dataclass
class Layer:
    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    attrs: dict[str, Any] = field(default_factory=dict)
    forward_index: int | None = None
    tied: frozenset[int] = frozenset()  # ids of own params an earlier layer already holds

    def describe(self) -> dict[str, Any]:
        """The layer's entry in the run registration body (docs/wire-format.md)."""
        own = dict(self.module.named_parameters(recurse=False))
        return {
            "index": self.index,
            "name": self.name,
            "type": type(self.module).__name__,
            "param_count": sum(p.numel() for p in own.values() if id(p) not in self.tied),
            "dtype": _dtype_name(next(iter(own.values())).dtype) if own else None,
            "shapes": {k: list(p.shape) for k, p in own.items()},
            "attrs": self.attrs,
            "forward_index": self.forward_index,
        }


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else _dtype_name(dtype)


def _is_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or any(
        isinstance(getattr(module, a, None), int) and not isinstance(getattr(module, a), bool)
        for a in _HEAD_ATTRS
    ) or calls_attention(module)


def layer_attrs(module: nn.Module) -> dict[str, Any]:
    """Scalar attributes of the module, with the dimensions the analysis checks named as
    the wire format names them (Linear, Conv, Embedding, attention heads)."""
    attrs = {k: v for k, v in vars(module).items()
             if not k.startswith("_") and k != "training" and isinstance(v, _SCALAR)}
    if _is_attention(module):
        heads = next((attrs[a] for a in _HEAD_ATTRS if isinstance(attrs.get(a), int)), None)
        embed = next((attrs[a] for a in _EMBED_ATTRS if isinstance(attrs.get(a), int)), None)
        if heads:
            attrs["num_heads"] = heads
        if embed is not None:
            attrs["embed_dim"] = embed
        head_dim = attrs.get("head_dim") or attrs.get("head_size")
        if not head_dim and heads and embed:
            head_dim = embed // heads
        if head_dim:
            attrs["head_dim"] = head_dim
    return attrs


def discover_layers(model: nn.Module) -> list[Layer]:
    """Layers in registration order; host only, no device work. `torch.compile`
    wrappers are not layers and their `_orig_mod.` is not part of the names."""
    layers: list[Layer] = []
    holder: dict[int, str] = {}  # parameter id -> the first layer that holds it
    for path, module in model.named_modules():
        if is_compiled_wrapper(module):
            continue
        name = clean_name(path)
        own = list(module.parameters(recurse=False))
        has_children = next(module.children(), None) is not None
        if own or not has_children or _is_attention(module):
            layer = Layer(index=len(layers), name=name or "model", module=module,
                          params=own, attrs=layer_attrs(module))
            tied = {id(p) for p in own if id(p) in holder}
            if tied:
                layer.tied = frozenset(tied)
                layer.attrs["tied_to"] = holder[next(iter(tied))]
            for p in own:
                holder.setdefault(id(p), layer.name)
            layers.append(layer)
    return layers
