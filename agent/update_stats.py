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
- any other optimizer: not measured (`kind_of()` is None; the collector says so once).

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

from dataclasses import dataclass
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
    element and its sums scaled by the stride (an estimate; exact below). No host sync.

    Adam with host step counts (the default) is computed for all parameters at once: a
    few dozen device ops whatever the number of parameters (GPT-2's 148 took 175 ms of
    host time one op per parameter at a time). Otherwise about a dozen ops a parameter."""
    picked: list[Picked] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            row = wanted.get(id(p))
            grad = p.grad
            if row is None or grad is None:
                continue
            state = optimizer.state.get(p)
            if kind == "adam" and (not state or "exp_avg_sq" not in state):
                continue
            stride = max(1, -(-local(p.detach()).numel() // SAMPLE_ELEMENTS))

            def pick(t: torch.Tensor, stride: int = stride) -> torch.Tensor:
                return local(t).reshape(-1)[::stride]

            # every state tensor but the step count is shaped like the parameter
            state = {k: pick(v) if isinstance(v, torch.Tensor) and k != "step" else v
                     for k, v in (state or {}).items()}
            picked.append(Picked(row, group, pick(p.detach()), pick(grad), state, stride))
    if not picked:
        return None
    if kind == "adam" and all(_vectorizable(one) for one in picked):
        return [one.row for one in picked], _adam_sums(optimizer, picked)
    sums = []
    for one in picked:
        if kind == "adam":
            update, eps_mask, v_zero = _adam_update(optimizer, one.group, one.w, one.state,
                                                    one.grad)
        else:
            update, eps_mask, v_zero = _sgd_update(one.group, one.w, one.state,
                                                   one.grad), None, None
        sums.append(_one(one.w, one.grad, update, eps_mask, v_zero) * one.stride)
    return [one.row for one in picked], torch.stack(sums)


@dataclass
class Picked:
    """One parameter's sampled elements (views: no copy) and what its update needs."""

    row: int
    group: dict
    w: torch.Tensor
    grad: torch.Tensor
    state: dict
    stride: int


def _host_number(value: Any) -> bool:
    """A number or a CPU 0-d tensor: combined on the host without waiting for a device."""
    return not isinstance(value, torch.Tensor) or (value.device.type == "cpu"
                                                   and value.dim() == 0)


def _vectorizable(one: Picked) -> bool:
    """Adam's sums can be taken together: host step count and learning rate, plain betas
    and eps (a capturable Adam keeps its step on the device)."""
    group = one.group
    return (_host_number(one.state["step"]) and _host_number(group["lr"])
            and not any(isinstance(b, torch.Tensor) for b in group["betas"])
            and not isinstance(group["eps"], torch.Tensor))


def _to(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A small host tensor on `device` without waiting for it (pinned first on CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


# parameters concatenated at once: bounds the (elements, N_SUMS) float64 temporary to
# CHUNK * SAMPLE_ELEMENTS rows (256 * 4096 * 56 bytes = 59 MB)
CHUNK = 256


def _adam_sums(optimizer: Any, picked: list[Picked]) -> torch.Tensor:
    """`_adam_update` and `_one` for the picked parameters together, on their elements
    concatenated (a chunk per parameter dtype), with the same float32 arithmetic; the
    per-parameter sums are one `index_add`. The hyperparameters are per-element vectors
    made on the host and copied without waiting."""
    device = picked[0].w.device
    out = torch.zeros(len(picked), N_SUMS, dtype=torch.float64, device=device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, one in enumerate(picked):
        by_dtype.setdefault(one.w.dtype, []).append(i)
    for members in by_dtype.values():
        for first in range(0, len(members), CHUNK):
            chunk = members[first:first + CHUNK]
            out.index_copy_(0, _to(device, torch.tensor(chunk)),
                            _adam_chunk(optimizer, [picked[i] for i in chunk], device))
    return out


def _adam_chunk(optimizer: Any, ones: list[Picked], device: torch.device) -> torch.Tensor:
    groups = [one.group for one in ones]
    lengths = torch.tensor([one.w.numel() for one in ones])
    decays = [g.get("weight_decay", 0.0) if _decoupled(optimizer, g) else 0.0 for g in groups]
    # step counts and learning rates may be CPU tensors: combined as tensors, never read
    steps = _host_vector([one.state["step"] for one in ones])
    lr = _host_vector([g["lr"] for g in groups])
    beta = torch.tensor([g["betas"] for g in groups], dtype=torch.float64)
    decay = lr * torch.tensor(decays, dtype=torch.float64)
    host = torch.stack([1 - beta[:, 0] ** steps, 1 - beta[:, 1] ** steps,
                        torch.tensor([g["eps"] for g in groups], dtype=torch.float64), lr,
                        decay / (1 - decay)], dim=1).float()
    bias1, bias2, eps, lr, decoupled = _to(
        device, host.repeat_interleave(lengths, dim=0)).unbind(1)
    segment = _to(device, torch.repeat_interleave(torch.arange(len(ones)), lengths))
    w = torch.cat([one.w for one in ones])
    m = torch.cat([one.state["exp_avg"] for one in ones])
    v = torch.cat([one.state["max_exp_avg_sq" if one.group.get("amsgrad") else "exp_avg_sq"]
                   for one in ones])
    root = (v.float() / bias2).sqrt()
    update = m.float() / bias1 / (root + eps) * lr
    if any(decays):  # AdamW's decoupled decay
        update = update + (w.float() + update) * decoupled
    v_zero = torch.cat([one.state["exp_avg_sq"] for one in ones]) == 0
    columns = _columns(w, torch.cat([one.grad for one in ones]), update, root < eps, v_zero)
    sums = torch.zeros(len(ones), N_SUMS, dtype=torch.float64, device=device)
    sums.index_add_(0, segment, columns)
    strides = torch.tensor([float(one.stride) for one in ones], dtype=torch.float64)
    return sums * _to(device, strides).unsqueeze(1)


def _host_vector(values: list[Any]) -> torch.Tensor:
    """Numbers or CPU 0-d tensors as one float64 CPU tensor, without reading a tensor."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values).to(torch.float64)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])


def _columns(w: torch.Tensor, grad: torch.Tensor, update: torch.Tensor,
             eps_mask: torch.Tensor, v_zero: torch.Tensor) -> torch.Tensor:
    """Per element, the `SUMS` columns (float64) whose per-parameter sums `_one` takes."""
    wide = torch.float64
    weight = w.float()
    graded = grad != 0
    if w.dtype in LOW_PRECISION:
        moved = update != 0
        lost = (weight - update).to(w.dtype) == w
        lost, moved = lost & moved, moved
    else:
        lost = moved = torch.zeros_like(graded)
    return torch.stack([update.to(wide).square(), weight.to(wide).square(), lost.to(wide),
                        moved.to(wide), (eps_mask & graded).to(wide),
                        (v_zero & graded).to(wide), graded.to(wide)], dim=1)


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
