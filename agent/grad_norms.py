"""Per-parameter grad norms, taken once per backward (agent/grad_snapshot.py)."""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def grad_norms(grads: list[torch.Tensor], exact: bool = True,
               half: bool | None = None) -> list[torch.Tensor]:
    """Each grad's 2-norm in one `_foreach_norm`. `exact`: in float64, so a finite grad
    keeps a finite norm however large (in float32 the squares overflow above ~1.8e19);
    on the host that copies every grad first, about 20x the time. Else as
    `clip_grad_norm_` takes them, so the loop's clip can reuse them bitwise: in the
    grads' own precision, half-precision grads in float32. `half`: whether any grad is
    half precision, when the caller knows."""
    if exact:
        return torch._foreach_norm(grads, 2, dtype=torch.float64)
    if half is None:
        half = any(g.dtype in _HALF for g in grads)
    if half:
        return torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch._foreach_norm(grads, 2)


def kinds(grads: list[torch.Tensor]) -> tuple[bool, bool]:
    """(any grad in half precision, all in one dtype and on one device that is not half):
    the latter's norms taken in their own precision are exactly what torch's clip takes."""
    dtype, device = grads[0].dtype, grads[0].device
    half = any(g.dtype in _HALF for g in grads)
    return half, not half and all(g.dtype is dtype and g.device == device for g in grads)
