"""The per-layer search of a flagged step on the CPU: replay its forward and name the first
layer whose output held inf/NaN, in execution order.

A healthy step reads no layer output (docs/agent.md, "Cheap by design"). As each
unsampled training forward begins, the agent keeps references to its inputs and a copy
of the CPU RNG state; when the step's loss comes back inf/NaN (read as the backward
begins: on the CPU the loss is a host value, reading it waits for nothing), the forward
runs again under no_grad with the same weights (no update has run yet), inputs, RNG
state and autocast, through the eager module (a compiled model's `_orig_mod`: its
layers are named, and nothing is traced, so no graph break), with a forward hook on each
layer, for the replay only, that checks its output as it is produced, before a later
in-place op can change it. CPU kernels are deterministic: the replay computes the step's own values.
The model's buffers (BatchNorm statistics) are put back as they were after the replay.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampwatch.agent.collectors import finite_checks
from ampwatch.agent.collectors.finite_checks import FINITE, Call, first_float_tensor


@dataclass
class HeldForward:
    """One training forward's inputs as it began (references, and the RNG state copied)."""

    args: tuple
    kwargs: dict
    rng: torch.Tensor
    autocast: torch.dtype | None  # the CPU autocast dtype in effect as it began


def hold(args: tuple, kwargs: dict) -> HeldForward:
    """Training thread, CPU models only: a few KB of host copy, no tensor read."""
    autocast = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                else None)
    return HeldForward(args, dict(kwargs), torch.get_rng_state(), autocast)


def loss_is_bad(loss: torch.Tensor | None) -> bool:
    """Whether the step's loss says the search must run (unknown counts as bad). Host
    tensors only: reads the loss."""
    if loss is None:
        return True
    loss = loss.detach()
    if loss.numel() == 1:
        return not math.isfinite(loss.item())
    return not bool(torch.isfinite(loss).all())


def first_bad_output(module: nn.Module, held: HeldForward,
                     layers: list[tuple[int, nn.Module]]) -> Call | None:
    """Replay `held` through `module.forward` (its own hooks bypassed: the agent's root
    hooks must not count it as a training forward); the first output of `layers` (index,
    module) with inf/NaN as a call (layer index, dtype, (min, max)), or None when every
    output is finite. Each layer's check is its last forward hook, as the agent's own
    are: it sees the output the user's hooks returned."""
    found: list[Call] = []

    def check(index: int, output: Any) -> None:
        if found:
            return
        tensor = first_float_tensor(output)
        if tensor is not None and tensor.numel():
            stats = finite_checks.finite_check(tensor.detach())
            # a sum of finite values can overflow: then the exact (min, max) decides
            if stats is not FINITE and not (math.isfinite(stats[0])
                                            and math.isfinite(stats[1])):
                found.append((index, tensor.dtype, stats, None, None))

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    handles = [layer.register_forward_hook(
        lambda m, a, out, index=index: check(index, out)) for index, layer in layers]
    autocast = (torch.autocast("cpu", dtype=held.autocast) if held.autocast is not None
                else contextlib.nullcontext())
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast:
            torch.set_rng_state(held.rng)
            module.forward(*held.args, **held.kwargs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, value in module.named_buffers():
                if name in buffers and value.shape == buffers[name].shape:
                    value.copy_(buffers[name])
    return found[0] if found else None

