"""Running a recorded step again: the forward(s) and backward in the recorded precision,
with chosen modules taken out of autocast (the bisection's trials)."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampwatch.agent.fp8 import find_fp8_layers
from ampwatch.agent.layers import discover_layers
from ampwatch.replay.bundle import Bundle

LossFn = Callable[..., torch.Tensor]


@dataclass
class StepOutcome:
    """What one run of the step showed. `order`: every submodule's name in the order its
    forward finished (the bisection searches over it); `first_offender`: the first of
    the agent's layers whose output held inf/NaN, in that order."""

    loss: float | None
    first_offender: str | None
    forward_finite: bool
    grads_finite: bool | None  # None: no loss to run the backward from
    order: list[str] = field(default_factory=list)
    loss_limit: float | None = None  # a loss-spike bundle: a loss over this is still bad

    @property
    def finite(self) -> bool:
        """Whether the forward, the gradients and the loss held no inf/NaN."""
        return self.forward_finite and self.grads_finite is not False and (
            self.loss is None or math.isfinite(self.loss))

    @property
    def bad(self) -> bool:
        """Not finite, or (a loss-spike bundle) a loss over `loss_limit`."""
        return not self.finite or (self.loss_limit is not None and self.loss is not None
                                   and abs(self.loss) > self.loss_limit)


def default_loss(output: Any, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The loss when the factory gives no loss function: a scalar output, or the output's
    `loss` (an HF-style model called with labels). None: forward only."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 and output.is_floating_point() else None
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _nonfinite(value: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
               for t in _tensors(value))


def _move(value: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


def upcast(model: nn.Module, names: Iterable[str], device_type: str) -> ExitStack:
    """Take the named modules out of autocast (their floating inputs and parameters in
    float32; an FP8 layer computes as a plain Linear) until the returned stack closes."""
    stack = ExitStack()
    fp8 = {id(layer.module) for layer in find_fp8_layers(discover_layers(model))}
    for name in names:
        module = model.get_submodule(name)
        contexts: list[Any] = []

        def pre(mod: nn.Module, args: tuple, kwargs: dict, contexts: list = contexts) -> Any:
            context = torch.autocast(device_type, enabled=False)
            context.__enter__()
            contexts.append(context)
            return _move(args, args[0].device if args and isinstance(args[0], torch.Tensor)
                         else torch.device(device_type), torch.float32), _move(
                kwargs, torch.device(device_type), torch.float32)

        def post(mod: nn.Module, args: tuple, output: Any, contexts: list = contexts) -> None:
            contexts.pop().__exit__(None, None, None)

        stack.callback(module.register_forward_pre_hook(pre, with_kwargs=True).remove)
        stack.callback(module.register_forward_hook(post, always_call=True).remove)
        low = {n: p.dtype for n, p in module.named_parameters(recurse=False)
               if p.dtype in (torch.float16, torch.bfloat16)}
        if low:
            for n in low:
                getattr(module, n).data = getattr(module, n).data.float()
            stack.callback(_restore_dtypes, module, low)
        if id(module) in fp8:
            module.forward = types.MethodType(nn.Linear.forward, module)
            stack.callback(module.__dict__.pop, "forward", None)
    return stack


def _restore_dtypes(module: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    for n, dtype in dtypes.items():
        getattr(module, n).data = getattr(module, n).data.to(dtype)


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


def matching_keys(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The recorded state dict with the prefixes of wrappers the training model had (DDP's
    `module.`, torch.compile's `_orig_mod.`) and the replay model lacks taken off."""
    wanted = set(model.state_dict())
    for prefix in WRAPPER_PREFIXES:
        if not set(state) & wanted and all(k.startswith(prefix) for k in state):
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def forward_entries(model: nn.Module, bundle: Bundle) -> list[nn.Module]:
    """Per recorded forward, the module the training loop called: the model, or the
    submodule it called itself (a LightningModule's `self.net(x)`), by its name in the
    bundle, less any wrapper's prefix (DDP's `module`). A name the model does not have is
    the wrong model for this bundle: a ValueError that says so."""
    names = bundle.meta.get("forward_entries") or [""] * len(bundle.batches)
    if len(names) != len(bundle.batches) or not all(isinstance(n, str) for n in names):
        raise ValueError("the bundle's forward_entries do not match its batches")
    modules = dict(model.named_modules())
    entries = []
    for name in names:
        for prefix in ("", *WRAPPER_PREFIXES):
            if name == prefix.rstrip("."):
                name = ""
            name = name.removeprefix(prefix)
            if name in modules:
                break
        else:
            raise ValueError(f"the bundle's forward entered the model by a submodule named "
                             f"{name[:200]!r}, which this model does not have: is it the "
                             f"model that was trained?")
        entries.append(modules[name])
    return entries


def run_step(model: nn.Module, bundle: Bundle, *, loss_fn: LossFn | None = None,
             device: str | torch.device = "cpu", upcast_names: Iterable[str] = (),
             loss_limit: float | None = None) -> StepOutcome:
    """Load the bundle's state into `model`, restore the RNG, run each recorded forward
    under the recorded autocast and its backward from the loss scaled as the scaler
    scaled it. Synchronises the device (it reads the results)."""
    device = torch.device(device)
    model.load_state_dict(matching_keys(bundle.model_state, model))
    model.to(device)
    model.train()
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(bundle.rng["cpu"])
    if device.type == "cuda" and "cuda" in bundle.rng:
        torch.cuda.set_rng_state(bundle.rng["cuda"], device)
    layer_names = {id(layer.module): layer.name for layer in discover_layers(model)}
    order: list[str] = []
    offenders: list[str] = []
    names = {id(m): n for n, m in model.named_modules() if n}

    def finished(module: nn.Module, args: tuple, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        if name not in order:
            order.append(name)
        if id(module) in layer_names and _nonfinite(output):
            offenders.append(name)

    dtype = bundle.autocast_dtype
    scale = bundle.loss_scale
    losses: list[float] = []
    forward_finite = True
    ran_backward = False
    with ExitStack() as stack:
        for module in model.modules():
            stack.callback(module.register_forward_hook(finished).remove)
        stack.enter_context(upcast(model, upcast_names, device.type))
        for (args, kwargs), entry in zip(bundle.batches, forward_entries(model, bundle),
                                         strict=True):
            args, kwargs = _move(args, device), _move(kwargs, device)
            with torch.autocast(device.type, dtype=dtype or torch.float32,
                                enabled=dtype is not None):
                output = entry(*args, **kwargs)
                loss = (loss_fn or default_loss)(output, *args, **kwargs)
            forward_finite = forward_finite and not _nonfinite(output)
            if loss is None:
                continue
            losses.append(float(loss.detach().float()))
            (loss.float() * scale if scale else loss).backward()
            ran_backward = True
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads_finite = (all(bool(torch.isfinite(g).all()) for g in grads)
                    if ran_backward else None)
    model.zero_grad(set_to_none=True)
    return StepOutcome(loss=sum(losses) if losses else None,
                       first_offender=offenders[0] if offenders else None,
                       forward_finite=forward_finite, grads_finite=grads_finite,
                       order=order, loss_limit=loss_limit)
