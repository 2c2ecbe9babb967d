"""Where a step's forward enters the model, and torch.compile around it.

The model, the module it wraps and its children that hold parameters each get a forward
pre- and post-hook; the first of them the loop calls owns that forward (a loop may call a
submodule itself: a LightningModule's `self.net(x)`). A model compiled after attach gets
its hooks back around the compiled call. Host only; no device work.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampwatch.agent.compiled import is_compiled_wrapper

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch

_compiling = torch.compiler.is_compiling  # dynamo folds it to True while tracing a hook


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (host only)."""
    return torch._C._current_graph_task_id() != -1


class ForwardEntries:
    """The forward entry hooks of one loop watch: `on_forward_begin`/`on_forward_end` for
    the step's forwards, once each however many entry modules a forward passes."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self.owner: nn.Module | None = None  # the module whose hooks run this forward
        # the modules a forward may enter by, by their names in the model ("": the model)
        self._names: dict[int, str] = {}
        self._inplace_compiled: list[tuple[nn.Module, Callable]] = []

    def __deepcopy__(self, memo: dict) -> ForwardEntries:
        """A deep copy of the model copies the hooks bound to this object: they get a twin
        bound to the watch's inactive twin (LoopWatch.__deepcopy__)."""
        twin = copy.copy(self)
        twin.watch = copy.deepcopy(self.watch, memo)
        return twin

    @property
    def entry(self) -> str:
        """The name in the model of the module running the current forward ("": the
        model itself), for a replay to call the same one."""
        return "" if self.owner is None else self._names.get(id(self.owner), "")

    def install(self) -> None:
        for name, module in self._modules():
            self._names[id(module)] = name
            self.hook(module)

    def uninstall(self) -> None:
        """Put back what `module.compile()` compiled (the hooks are the watch's handles)."""
        for module, compiled in self._inplace_compiled:
            if getattr(module, "_compiled_call_impl", None) is not compiled:
                module._compiled_call_impl = compiled
        self._inplace_compiled.clear()

    def _modules(self) -> list[tuple[str, nn.Module]]:
        """The model, the module it wraps, and that module's children that hold parameters:
        a step's forward is whichever of them the loop calls first (a loss module or a
        metric, without parameters, is not a forward). A container's children are entered
        through the container's own forward, so only the model is hooked then."""
        model, inner = self.watch.model, self.watch.inner
        entries = [("", model)]
        if inner is not model:
            entries.append(("", inner))
        if not isinstance(inner, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            for name, child in inner.named_children():
                if next(child.parameters(), None) is not None:
                    entries.append((name, child))
        return entries

    def hook(self, module: nn.Module) -> None:
        self.watch.keep_handle(module.register_forward_pre_hook(
            self.forward_pre, with_kwargs=True))
        self.watch.keep_handle(module.register_forward_hook(
            self.forward_post, with_kwargs=True, always_call=True))

    # Traced by dynamo (a model compiled after attach), a hook returns at once: nothing is
    # added to the graph. The compile wrapper's hooks run eagerly around the compiled call;
    # the owner check keeps one forward from counting twice when dynamo falls back to eager.
    def forward_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        watch = self.watch
        if _compiling() or not watch.live or self.owner is not None:
            return
        if module is not watch.model and _in_backward():  # checkpointing's recompute
            return
        if watch.capturing():  # a CUDA graph's capture: no device work of ours in it
            return
        self.owner = module
        watch.backward_owner.forward_ran()
        training = watch.inner.training if module is watch.model else module.training
        watch.in_training_forward = training
        watch.dispatch("on_forward_begin", training, args, kwargs)

    def forward_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _compiling() or module is not self.owner:
            return
        watch = self.watch
        self.owner = None
        watch.in_training_forward = False
        if watch.live:
            watch.dispatch("on_forward_end", watch.inner.training, output)

    # ------------------------------------------------------------------ torch.compile
    def compile_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        """`torch.compile(model)` returned: hook the wrapper it made of our model."""
        watch = self.watch
        target = args[0] if args else kwargs.get("model")
        if not watch.active or not isinstance(target, nn.Module) or not self._owns(target):
            return
        if (target is watch.inner or target is watch.model) and is_compiled_wrapper(result):
            self.hook(result)  # its hooks run eagerly around the compiled call
        watch.note_compiled()

    def module_compile_after(self, result: Any, args: tuple, kwargs: dict, token: Any) -> None:
        """`module.compile()` returned: compiled in place."""
        module = args[0]
        if self.watch.active and self._owns(module):
            if module is self.watch.inner:
                self.wrap_inplace_compiled(module)
            self.watch.note_compiled()

    def _owns(self, module: nn.Module) -> bool:
        return module is self.watch.model or any(m is module for m in self.watch.inner.modules())

    def wrap_inplace_compiled(self, module: nn.Module) -> None:
        """`module.compile()` compiles its `_call_impl`, hooks included: run ours eagerly
        around the compiled call instead."""
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is None or any(m is module for m, _ in self._inplace_compiled):
            return
        pre, post = self.forward_pre, self.forward_post

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
