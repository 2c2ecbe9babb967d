"""The test's own view of attention: a module stack kept by global forward hooks, and a
TorchFunctionMode that sees each scaled_dot_product_attention call and, on transformers'
eager path, a wrapper of the modeling file's own `eager_attention_forward`; per forward,
the largest |q k^T| * scale of the first sequence, by the module that ran it."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from tests.zoo.models import Arch

SDPA = F.scaled_dot_product_attention  # torch's own (a mode sees it, not a wrapper of it)


class AttentionTruth(TorchFunctionMode):
    """Per forward, {module name: largest |q k^T| * scale} of each module that ran attention."""

    def __init__(self, model: nn.Module, arch: Arch) -> None:
        super().__init__()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.modules = [m for m in model.modules() if type(m).__name__ in arch.attention]
        self.stack: list[nn.Module] = []
        self.steps: list[dict[str, float]] = []

    def __enter__(self) -> AttentionTruth:
        self.handles = [module_hooks.register_module_forward_pre_hook(self._enter),
                        module_hooks.register_module_forward_hook(self._leave)]
        # transformers' eager path: the modeling file's own function, wrapped here
        self.eager = {sys.modules[type(m).__module__] for m in self.modules
                      if hasattr(sys.modules[type(m).__module__], "eager_attention_forward")}
        for modeling in self.eager:
            modeling.eager_attention_forward = self._eager(modeling.eager_attention_forward)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        for modeling in self.eager:
            modeling.eager_attention_forward = modeling.eager_attention_forward.original
        super().__exit__(*exc)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.stack.append(module)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop()

    def _note(self, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> None:
        running = next(m for m in reversed(self.stack) if id(m) in self.names)
        q, k = q.detach()[0].float(), k.detach()[0].float()  # the first sequence
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)  # grouped queries
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        value = float((q @ k.transpose(-2, -1)).abs().max()) * scale
        name = self.names[id(running)]
        self.steps[-1][name] = max(value, self.steps[-1].get(name, 0.0))

    def _eager(self, original: Any) -> Any:
        def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                    *args: Any, **kwargs: Any) -> Any:
            self._note(query, key, kwargs.get("scaling"))
            return original(module, query, key, *args, **kwargs)
        eager_attention_forward.original = original  # type: ignore[attr-defined]
        return eager_attention_forward

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            self._note(args[0], args[1], kwargs.get("scale"))
        return func(*args, **kwargs)
