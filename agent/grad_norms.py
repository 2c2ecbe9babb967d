"""Per-parameter grad norms, taken once per backward (agent/loop_watch.py)."""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each grad's 2-norm in one `_foreach_norm`, as `clip_grad_norm_` takes them: in the
    grads' own precision (so a clip can reuse them, bitwise), half-precision grads in
    float32 (their own would overflow at 65504). Like torch's, a float32 norm is inf for a
    finite grad whose squares overflow (elements above ~1.8e19). A float64 norm would be
    exact there but costs a float64 copy of every grad on the host (20x the time)."""
    if any(g.dtype in _HALF for g in grads):
        return torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch._foreach_norm(grads, 2)


def torchs_own(grads: list[torch.Tensor], norms: torch.Tensor) -> bool:
    """Whether `norms` are what torch's clip takes for `grads`: one dtype (theirs), one
    device, in the grads' order."""
    dtype, device = norms.dtype, grads[0].device
    return all(g.dtype is dtype and g.device == device for g in grads)
