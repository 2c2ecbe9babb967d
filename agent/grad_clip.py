"""`clip_grad_norm_` computed the way torch computes it, keeping the per-parameter norms.

The agent needs each grad's norm at clip time; recomputing them would double the
loop's most expensive statistic. `prepare()` groups the grads by device and dtype and
takes their norms exactly as `torch.nn.utils.clip_grad_norm_` does, so the total norm
and the clipping that `apply()` performs are bitwise what the original would produce.
Does not synchronise the device (unless the caller asked for `error_if_nonfinite`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils import clip_grad
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


@dataclass
class PreparedClip:
    params: list[torch.Tensor]
    max_norm: float
    total: torch.Tensor
    error_if_nonfinite: bool
    foreach: bool | None
    norms: dict[int, torch.Tensor]  # grad norm per parameter id

    def apply(self) -> torch.Tensor:
        """Scale the grads as `clip_grad_norm_` does and return its total norm."""
        total = self.total
        if self.error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by "
                "the non-finite norm anyway, set `error_if_nonfinite=False`")
        clip_grad._clip_grads_with_norm_(self.params, self.max_norm, total, self.foreach)
        return total


@functools.lru_cache(maxsize=8)
def _signature(original: Callable) -> inspect.Signature:
    return inspect.signature(original)  # ~40 us a call: once per wrapped function


def bind(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments with defaults, `parameters` made a list (a generator can be
    consumed once: whoever clips must use this list)."""
    bound = _signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    parameters = arguments["parameters"]
    if isinstance(parameters, torch.Tensor):
        arguments["parameters"] = [parameters]
    else:
        was_generator = isinstance(parameters, types.GeneratorType)
        arguments["parameters"] = list(parameters)
        if was_generator and not arguments["parameters"]:
            arguments["parameters"] = (p for p in ())  # keep torch's empty-generator warning
    return arguments


def prepare(a: dict[str, Any], model_params: list[torch.nn.Parameter]) -> PreparedClip | None:
    """Norms of the grads a `clip_grad_norm_` call (arguments from `bind`) would clip, or
    None when the call is not the plain case (another norm type, other parameters than
    the model's, no grads): the caller then runs the original."""
    if float(a["norm_type"]) != 2.0 or not isinstance(a["parameters"], list):
        return None
    params = a["parameters"]
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad or {id(p) for p in with_grad} != {
            id(p) for p in model_params if p.grad is not None}:
        return None
    grads = [p.grad for p in with_grad]
    foreach = a["foreach"]
    norms: list[torch.Tensor | None] = [None] * len(grads)
    in_order: list[torch.Tensor] = []
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    with torch.no_grad():
        for (device, _), ([device_grads], indices) in grouped.items():
            if (foreach is None and _has_foreach_support(device_grads, device)) or (
                    foreach and _device_has_foreach_support(device)):
                group = list(torch._foreach_norm(device_grads, 2.0))
            elif foreach:
                return None
            else:
                group = [torch.linalg.vector_norm(g, 2.0) for g in device_grads]
            in_order.extend(group)
            for index, norm in zip(indices, group, strict=True):
                norms[index] = norm
        first_device = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in in_order]),
                                         2.0)
    return PreparedClip(params, float(a["max_norm"]), total, bool(a["error_if_nonfinite"]),
                        foreach, {id(p): n for p, n in zip(with_grad, norms, strict=True)})
