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
import operator
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
    with_grad: list[torch.Tensor]  # the params that have a grad, in the call's order
    grads: list[torch.Tensor]  # their grads, same order
    model_order: bool  # whether that order is the model's (its parameter order)
    norms: list[torch.Tensor]  # their grad norms, same order
    stacked: torch.Tensor  # the norms stacked as the total's pass stacked them
    in_param_order: bool  # whether `stacked` is in `with_grad` order (one device and dtype)

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

    def norms_for(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The grad norms of `params` (the same set as `with_grad`) stacked in their order;
        usually the total's own stack, reused."""
        if self.in_param_order and _same(params, self.with_grad):
            return self.stacked
        by_id = {id(p): n for p, n in zip(self.with_grad, self.norms, strict=True)}
        return torch.stack([by_id[id(p)] for p in params])


def _same(a: list, b: list) -> bool:
    return a is b or (len(a) == len(b) and all(map(operator.is_, a, b)))


def _arguments(parameters: Any, max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> dict[str, Any]:
    """`clip_grad_norm_`'s signature: Python binds the call (a TypeError as torch's)."""
    return {"parameters": parameters, "max_norm": max_norm, "norm_type": norm_type,
            "error_if_nonfinite": error_if_nonfinite, "foreach": foreach}


@functools.lru_cache(maxsize=8)
def _binder(original: Callable) -> Callable[..., dict[str, Any]]:
    """`_arguments` when `original` has that very signature (it has since torch 2.0), else
    inspect's general binding (~40 us to build, ~50 us a call: once per wrapped function)."""
    signature = inspect.signature(original)
    if _shape(signature) == _shape(inspect.signature(_arguments)):
        return _arguments

    def general(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    return general


def _shape(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def bind(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments with defaults, `parameters` made a list (a generator can be
    consumed once: whoever clips must use this list)."""
    arguments = _binder(original)(*args, **kwargs)
    parameters = arguments["parameters"]
    if isinstance(parameters, torch.Tensor):
        arguments["parameters"] = [parameters]
    else:
        was_generator = isinstance(parameters, types.GeneratorType)
        arguments["parameters"] = list(parameters)
        if was_generator and not arguments["parameters"]:
            arguments["parameters"] = (p for p in ())  # keep torch's empty-generator warning
    return arguments


def prepare(a: dict[str, Any], model_params: list[torch.Tensor],
            model_with_grad: list[torch.Tensor]) -> PreparedClip | None:
    """Norms of the grads a `clip_grad_norm_` call (arguments from `bind`) would clip, or
    None when the call is not the plain case (another norm type, other parameters than
    the model's with grads, `model_with_grad`, or no grads): the caller then runs the
    original. `model_params`: all the model's parameters, in order (the usual call clips
    exactly those)."""
    if float(a["norm_type"]) != 2.0 or not isinstance(a["parameters"], list):
        return None
    params = a["parameters"]
    if _same(params, model_params):
        with_grad = model_with_grad
    else:
        with_grad = [p for p in params if p.grad is not None]
        if not (_same(with_grad, model_with_grad) or (
                len(with_grad) == len(model_with_grad)
                and {id(p) for p in with_grad} == {id(p) for p in model_with_grad})):
            return None
    if not with_grad:
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
        stacked = torch.stack([n.to(first_device) for n in in_order])
        total = torch.linalg.vector_norm(stacked, 2.0)
    return PreparedClip(params, float(a["max_norm"]), total, bool(a["error_if_nonfinite"]),
                        foreach, with_grad, grads, _same(with_grad, model_with_grad),
                        norms, stacked,  # type: ignore[arg-type]
                        in_param_order=_same(in_order, norms))
