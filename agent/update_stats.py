"""What the optimizer step just did to each parameter, read from the optimizer's own state
after `step()` returned: the update's squared norm, the weight's squared norm, how many
elements of the update the parameter's dtype rounded away, and for Adam-family
optimizers how many elements had eps dominating the denominator or a zero second moment
while their gradient was not zero.

The update is rebuilt from the state, never from a copy of the weights:
- Adam, AdamW (and subclasses keeping `exp_avg`/`exp_avg_sq`): `lr * m_hat / (sqrt(v_hat) +
  eps)`, plus `lr * weight_decay * w_before` when the decay is decoupled (AdamW), with the bias
  corrections of the state's step count (the `max_exp_avg_sq` under amsgrad);
- SGD: `lr * momentum_buffer` (Nesterov: `lr * (g + momentum * buffer)`), or `lr * g` without
  momentum, the weight decay folded in as SGD does;
- any other optimizer: not measured (`supported()` is False; the collector says so once).

Rounding: an element's update is lost when `w - delta`, rounded to the parameter's dtype, is
`w` again (bf16 and fp16 parameters only). It is judged against the weight after the step,
which is the weight before it exactly when the update was lost (then `w_new == w_old`),
so a lost element is always counted; an element that moved is judged one ULP away, which
can differ from the true answer only at a binade edge.

Shares are over the elements whose gradient is not zero (an unused embedding row has
zero gradient and zero moments: it is neither eps-dominated nor underflowed). Everything
is tensor ops on the optimizer's tensors (a step count or learning rate held in a tensor
stays one: a 0-d CPU tensor combines with device tensors without a copy back): nothing
here synchronises the device.
"""

from __future__ import annotations

from typing import Any

import torch

# the columns of `param_sums`, in order
SUMS = ("update_sq", "weight_sq", "lost", "moved", "eps_dominated", "v_zero", "grad_nonzero")
N_SUMS = len(SUMS)
LOW_PRECISION = (torch.bfloat16, torch.float16)
# elements of a parameter read per sample, evenly strided: the sums are scaled back by the
# stride. A step of a 4M-parameter model reads 4M elements a dozen times over without it
# (more than the step itself on a CPU); with it, each parameter costs its dozen small ops.
SAMPLE_ELEMENTS = 4096


def kind_of(optimizer: Any) -> str | None:
    """'adam', 'sgd', or None for an optimizer whose update is not rebuilt."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    return None


def _decoupled(optimizer: Any, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False))


def _adam_update(optimizer: Any, group: dict, p: torch.Tensor, state: dict,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(update, eps-dominated mask, zero second moment mask) of one Adam parameter."""
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    lr = group["lr"]
    step = state["step"]
    v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    root = (v.float() / bias2).sqrt()
    update = state["exp_avg"].float() / bias1 / (root + eps) * lr
    weight_decay = group.get("weight_decay", 0.0)
    if weight_decay and _decoupled(optimizer, group):
        # the step was w_new = w_old * (1 - lr * wd) - update: the decay is of w_old
        decay = lr * weight_decay
        update = update + (p.detach().float() + update) * (decay / (1 - decay))
    return update, root < eps, state["exp_avg_sq"] == 0


def _sgd_update(group: dict, p: torch.Tensor, state: dict, grad: torch.Tensor) -> torch.Tensor:
    lr = group["lr"]
    buffer = state.get("momentum_buffer")
    momentum = group.get("momentum", 0.0)
    if momentum and buffer is not None:
        if group.get("nesterov"):
            g = grad.float()
            if group.get("weight_decay"):
                g = g + p.detach().float() * group["weight_decay"]
            return (g + buffer.float() * momentum) * lr
        return buffer.float() * lr
    g = grad.float()
    if group.get("weight_decay"):
        g = g + p.detach().float() * group["weight_decay"]
    return g * lr


def param_sums(optimizer: Any, kind: str, wanted: dict[int, int],
               local: Any = lambda t: t) -> tuple[list[int], torch.Tensor] | None:
    """Per parameter of `wanted` (id -> row) that the optimizer stepped: its row and
    the `SUMS` as one (n, N_SUMS) float64 tensor on the parameters' device; None when no
    wanted parameter has a state and a gradient. `local` turns a sharded tensor into this
    rank's part. A parameter over SAMPLE_ELEMENTS elements is read on every stride-th
    element and its sums scaled by the stride (an estimate; exact below). Launches about
    a dozen device ops per parameter; no host sync."""
    rows: list[int] = []
    sums: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            row = wanted.get(id(p))
            grad = p.grad
            if row is None or grad is None:
                continue
            state = optimizer.state.get(p)
            if kind == "adam" and (not state or "exp_avg_sq" not in state):
                continue
            w = local(p.detach())
            stride = max(1, -(-w.numel() // SAMPLE_ELEMENTS))

            def pick(t: torch.Tensor, stride: int = stride) -> torch.Tensor:
                return local(t).reshape(-1)[::stride]

            w, grad = pick(p.detach()), pick(grad)
            if kind == "adam":
                state = {k: pick(v) if isinstance(v, torch.Tensor) and v.dim() else v
                         for k, v in state.items()}
                update, eps_mask, v_zero = _adam_update(optimizer, group, w, state, grad)
            else:
                state = {k: pick(v) for k, v in (state or {}).items()
                         if isinstance(v, torch.Tensor) and v.dim()}
                update, eps_mask, v_zero = _sgd_update(group, w, state, grad), None, None
            one = _one(w, grad, update, eps_mask, v_zero)
            sums.append(one if stride == 1 else one * stride)
            rows.append(row)
    if not sums:
        return None
    return rows, torch.stack(sums)


def _one(w: torch.Tensor, grad: torch.Tensor, update: torch.Tensor,
         eps_mask: torch.Tensor | None, v_zero: torch.Tensor | None) -> torch.Tensor:
    """The SUMS of one parameter as an (N_SUMS,) float64 tensor; missing ones are 0."""
    wide = torch.float64
    weight = w.float()
    zero = torch.zeros((), dtype=wide, device=w.device)
    if w.dtype in LOW_PRECISION:
        moved = update != 0
        kept = (weight - update).to(w.dtype) == w
        lost = (kept & moved).sum().to(wide)
        moved = moved.sum().to(wide)
    else:
        lost = moved = zero
    graded = grad != 0
    if eps_mask is not None:
        eps_dominated = (eps_mask & graded).sum().to(wide)
        v_zero = (v_zero & graded).sum().to(wide)
    else:
        eps_dominated = v_zero = zero
    return torch.stack([update.square().sum(dtype=wide), weight.square().sum(dtype=wide),
                        lost, moved, eps_dominated, v_zero, graded.sum().to(wide)])
