"""Per-parameter grad norms, taken once per backward (agent/grad_snapshot.py)."""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def grad_norms(grads: list[torch.Tensor], exact: bool = True) -> list[torch.Tensor]:
    """Each grad's 2-norm in one `_foreach_norm`. `exact`: in float64, so a finite grad
    keeps a finite norm however large (in float32 the squares overflow above ~1.8e19);
    on the host that copies every grad first, about 20x the time. Else as
    `clip_grad_norm_` takes them, so the loop's clip can reuse them bitwise: in the
    grads' own precision, half-precision grads in float32."""
    if exact:
        return torch._foreach_norm(grads, 2, dtype=torch.float64)
    if any(g.dtype in _HALF for g in grads):
        return torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch._foreach_norm(grads, 2)


def torchs_own(grads: list[torch.Tensor], norms: torch.Tensor) -> bool:
    """Whether `norms` are what torch's clip takes for `grads`: one dtype (theirs), one
    device, in the grads' order."""
    dtype, device = norms.dtype, grads[0].device
    return all(g.dtype is dtype and g.device == device for g in grads)
