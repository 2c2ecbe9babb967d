"""torch.compile support: which modules are compiled wrappers, layer names without the
wrapper's `_orig_mod.`, and a count of compilations so that compiling is not timed as a
forward.

Compiled code never runs the agent's hooks: a hook traced by dynamo returns at once
(`torch.compiler.is_compiling()`), so it adds nothing to the graph and no graph break.
The top-level forward facts come from hooks on the `OptimizedModule` wrapper, which runs
them eagerly around the compiled call; per-layer hooks are not registered on a compiled
model (see docs/agent.md, "Compiled models"). Nothing here imports torch._dynamo unless
a compiled model is seen (it is already imported then).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from torch import nn

WRAPPER_ATTR = "_orig_mod"


def is_compiled_wrapper(module: Any) -> bool:
    """Is `module` the `OptimizedModule` that `torch.compile(model)` returns?"""
    return (type(module).__name__ == "OptimizedModule"
            and isinstance(getattr(module, WRAPPER_ATTR, None), nn.Module))


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside any number of `torch.compile` wrappers."""
    while is_compiled_wrapper(module):
        module = getattr(module, WRAPPER_ATTR)
    return module


def is_compiled(module: nn.Module) -> bool:
    """Is `module`, or a module inside it, compiled: by `torch.compile` (a wrapper) or in
    place by `.compile()`? Walks the modules once (host only)."""
    return is_compiled_wrapper(module) or any(
        is_compiled_wrapper(m) or getattr(m, "_compiled_call_impl", None) is not None
        for m in unwrap(module).modules())


def clean_name(name: str) -> str:
    """A module path without the compile wrappers' `_orig_mod` segments."""
    return ".".join(part for part in name.split(".") if part != WRAPPER_ATTR)


class CompileCounter:
    """Counts dynamo compilations through its compile-start callback (host only; a
    compile of a frame costs seconds, the callback nothing). Registered only once a
    compiled model is seen."""

    def __init__(self) -> None:
        self.count = 0
        self._handler: Any = None

    def start(self) -> None:
        if self._handler is not None or "torch._dynamo" not in sys.modules:
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._on_start)
        self._handler = callback_handler

    def stop(self) -> None:
        if self._handler is not None:
            with contextlib.suppress(ValueError):
                self._handler.remove_start_callback(self._on_start)
            self._handler = None

    def _on_start(self, *args: Any) -> None:
        self.count += 1
