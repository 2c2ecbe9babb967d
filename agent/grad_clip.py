"""The arguments of a clip call (`clip_grad_norm_`, `clip_grads_with_norm_`), bound once.

The agent does not take its gradient norms from the clip (it takes them as backward ends,
before any clip); it only needs to know which parameters a clip touched and its
`max_norm`, so each call's arguments are bound to keyword arguments before any listener
sees them, the way Python itself would bind them.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch


def _arguments(parameters: Any, max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> dict[str, Any]:
    """`clip_grad_norm_`'s signature: Python binds the call (a TypeError as torch's)."""
    return {"parameters": parameters, "max_norm": max_norm, "norm_type": norm_type,
            "error_if_nonfinite": error_if_nonfinite, "foreach": foreach}


@functools.lru_cache(maxsize=8)
def _binder(original: Callable) -> Callable[..., dict[str, Any]]:
    """`_arguments` when `original` has that very signature (clip_grad_norm_ has since
    torch 2.0), else inspect's general binding (~40 us to build, ~50 us a call)."""
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
