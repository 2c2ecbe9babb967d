"""On-demand fp32 versus AMP speed check of a private copy of the model."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from ampwatch.agent.layers import dtype_name

WARMUP_STEPS = 2


_FORWARD_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                       "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def _private_copy(watch: Any) -> torch.nn.Module:
    """A deep copy of the model without forward hooks (the agent's would record it)."""
    memo: dict[int, Any] = {}
    for module in watch.model.modules():
        for attr in _FORWARD_HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    return copy.deepcopy(watch.model, memo)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(model: torch.nn.Module, batch: Any, loss_fn: Any, steps: int,
                device: torch.device, dtype: torch.dtype | None) -> float:
    args = batch if isinstance(batch, tuple | list) else (batch,)
    times = []
    for i in range(WARMUP_STEPS + steps):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(*args))
        loss.backward()
        _sync(device)
        if i >= WARMUP_STEPS:
            times.append((time.perf_counter() - start) * 1000.0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def measure_speedup(watch: Any, batch: Any, loss_fn: Any, steps: int,
                    dtype: torch.dtype | None) -> dict[str, Any]:
    """Median forward+backward milliseconds in fp32 and under autocast; synchronises."""
    device = watch.device
    if dtype is None:
        chosen = watch.training_autocast
        dtype = (getattr(torch, chosen) if chosen and chosen != "mixed" else
                 torch.float16 if device.type == "cuda" else torch.bfloat16)
    twin = _private_copy(watch)
    twin.train()
    fp32_ms = _time_steps(twin, batch, loss_fn, steps, device, None)
    amp_ms = _time_steps(twin, batch, loss_fn, steps, device, dtype)
    return {"fp32_ms": fp32_ms, "amp_ms": amp_ms, "speedup": fp32_ms / amp_ms,
            "dtype": dtype_name(dtype)}
