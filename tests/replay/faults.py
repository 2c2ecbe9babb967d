"""Seeded numerical faults in small real models, and the training loop that runs them.

Every model is `Net`: `inp` (Linear) -> GELU -> `mid` (the module under test) ->
LayerNorm -> `out` (Linear), whose forward takes (x, y) and returns the loss, so a bundle's
batch holds everything its step needs. A fault names the module it injects (`injected`),
the step from which it acts, and how it acts (weights, buffers or data). Ground truth for
each step comes from the loop's own reads of the loss and the grads, never the agent.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

STEPS = 14
BAD_FROM = 8  # the step at which a fault starts acting (after a healthy streak)


class Net(nn.Module):
    def __init__(self, mid: nn.Module, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.mid = mid
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if isinstance(self.mid, NaiveLogit):
            self.mid.labels = (y[:, :1] > 0).float()
        h = self.out(self.norm(self.mid(F.gelu(self.inp(x)))))
        loss = F.mse_loss(h.float(), y)
        aux = getattr(self.mid, "aux", None)
        return loss if aux is None else loss + aux.float()


class Gain(nn.Module):
    """A Linear followed by a fixed gain (an unscaled projection)."""

    def __init__(self, gain: float, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.gain


class ManualSoftmax(nn.Module):
    """Attention-like scores with a hand-written softmax (exp in the input's dtype)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.score = nn.Linear(width, width)
        self.value = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.score(x) * 8.0
        weights = logits.exp()
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.value(x)


class RmsNormalize(nn.Module):
    """x / sqrt(sum(x^2)) in the input's dtype: a near-zero x underflows to 0 / 0."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h / (h * h).sum(-1, keepdim=True).sqrt()


class _LoudGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `gain` in its dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gain)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (gain,) = ctx.saved_tensors
        return grad * gain.to(grad.dtype), None


class LoudBackward(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("gain", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LoudGrad.apply(self.proj(x), self.gain)


class Gram(nn.Module):
    """A Gram-matrix feature (x x^T x): fine in float32, overflows as an fp16 matmul."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h @ h.transpose(0, 1)) @ h / 1e4


class NaiveLogit(nn.Module):
    """A gate trained with a hand-written binary cross-entropy (its `aux` loss, on the
    labels the parent sets): -log(1 - sigmoid(z)) for a negative label. In bfloat16
    sigmoid(z) rounds to 1 for z above about 5.5 and the log of 0 is -inf; float32 holds
    until about 17. A learning rate too high makes z swing ever wider until it is there."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 1)
        self.labels: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.gate(x))
        labels = self.labels
        self.aux = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()
        return x


@dataclass
class Fault:
    name: str
    mid: Callable[[], nn.Module]
    injected: str | None  # the module whose upcast fixes the step (None: none can)
    precision: str = "float16"  # float16 (with a GradScaler), bfloat16, fp8
    data: Callable[[int, torch.Tensor], torch.Tensor] = lambda step, x: x
    inject: Callable[[int, Net], None] = lambda step, model: None
    lr: float = 1e-3
    bad_from: int = BAD_FROM  # no bundle before this step
    gate_lr: float | None = None  # a learning rate of its own for `mid.gate`
    target: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda x, y: y
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = STEPS


def _scale_from(step_from: int, factor: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
    return lambda step, x: x * factor if step >= step_from else x


def _one_batch(step_at: int, factor: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
    return lambda step, x: x * factor if step == step_at else x


def _nan_at(step_at: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    def data(step: int, x: torch.Tensor) -> torch.Tensor:
        if step == step_at:
            x = x.clone()
            x[0, 3] = float("nan")
        return x
    return data


def _explode(step: int, model: Net) -> None:
    if step == BAD_FROM:
        with torch.no_grad():
            model.mid.weight.mul_(3e5)


def _vanish(step: int, model: Net) -> None:
    if step == BAD_FROM:
        with torch.no_grad():
            model.mid.proj.weight.mul_(1e-6)


def _loud(step: int, model: Net) -> None:
    if step == BAD_FROM:
        model.mid.gain.fill_(1e6)


def _fp8_outlier(step: int, model: Net) -> None:
    if step == FP8_AT:
        with torch.no_grad():
            model.inp.weight[0, 0] = 1e30  # input feature 0 is always 0: harmless in fp32


def _zero_feature(step: int, x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[:, 0] = 0.0
    return x


def _learnable(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x[:, 1:5] * 2.0  # a target the model can learn, so a broken layer shows


FP8_AT = 40
SPIKE = {"loss_spike": 4.0}

FAULTS = [
    Fault("fp16_layer_overflow", lambda: Gain(4000.0), "mid",
          data=_scale_from(BAD_FROM, 100.0)),
    Fault("one_step_bad_batch", lambda: nn.Linear(32, 32), "inp",
          data=_one_batch(BAD_FROM, 5e5)),
    Fault("nan_in_input", lambda: nn.Linear(32, 32), None, data=_nan_at(BAD_FROM)),
    Fault("exploding_weights", lambda: nn.Linear(32, 32), "mid", inject=_explode),
    Fault("softmax_huge_logits", ManualSoftmax, "mid", data=_scale_from(BAD_FROM, 6.0)),
    Fault("near_zero_norm", RmsNormalize, "mid", inject=_vanish),
    Fault("custom_function_overflow", LoudBackward, "mid", inject=_loud,
          record={"skip_after_streak": 5}),
    Fault("fp8_outlier", lambda: nn.Linear(32, 32), "inp", precision="fp8",
          data=_zero_feature, inject=_fp8_outlier, lr=0.1, target=_learnable, record=SPIKE,
          steps=FP8_AT + 4, bad_from=FP8_AT),
    Fault("bf16_high_lr", NaiveLogit, "mid", precision="bfloat16", lr=1e-2, gate_lr=6.0,
          steps=16, bad_from=0),
    Fault("autocast_only", Gram, "mid", data=_scale_from(BAD_FROM, 40.0)),
]


def build(fault: Fault, fix: dict[str, Any] | None = None) -> Net:
    """The fault's model as training builds it (`fix`: the namespace of a printed fix)."""
    torch.manual_seed(0)
    model = Net(fault.mid())
    if fault.precision == "fp8":
        from torchao import float8

        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
        keep = (fix or {}).get("module_filter_fn")
        float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    elif fix is not None and "keep_in_fp32" in fix:
        fix["keep_in_fp32"](model)
    return model


@dataclass
class StepTruth:
    loss: float
    grads_finite: bool


def train(fault: Fault, attach: Callable[..., Any] | None = None,
          fix: dict[str, Any] | None = None, record: Any = None
          ) -> tuple[list[StepTruth], Any]:
    """Train the fault's model; each step's truth read by the loop itself. `record`: the
    recorder's settings (default: the fault's, with a healthy streak of 5 steps)."""
    model = build(fault, fix)
    gate = list(model.mid.gate.parameters()) if fault.gate_lr is not None else []
    rest = [p for p in model.parameters() if all(p is not g for g in gate)]
    optimizer = torch.optim.SGD([{"params": rest}, {"params": gate, "lr": fault.gate_lr}]
                                if gate else rest, lr=fault.lr)
    scaler = torch.amp.GradScaler("cpu") if fault.precision == "float16" else None
    attachment = None
    if attach is not None:
        attachment = attach(model, scaler, record={"skip_after_streak": 5, **fault.record}
                            if record is None else record)
    dtype = torch.float16 if fault.precision == "float16" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    truths = []
    for step in range(fault.steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        x = fault.data(step, x)
        y = fault.target(x, y)
        fault.inject(step, model)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all())
                           for p in model.parameters() if p.grad is not None)
        truths.append(StepTruth(float(loss.detach()), grads_finite))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return truths, attachment


def first_bad_step(fault: Fault, truths: list[StepTruth]) -> int | None:
    """The step the recorder should keep, from the loop's own numbers: the first from
    `fault.bad_from` with a non-finite loss or grads, or a spiking loss (before it, a
    GradScaler calibrating skips steps with overflowing scaled grads: not a fault)."""
    factor = fault.record.get("loss_spike")
    healthy: list[float] = []
    for step, truth in enumerate(truths):
        if step >= fault.bad_from and (not math.isfinite(truth.loss)
                                       or not truth.grads_finite):
            return step
        if factor is not None and len(healthy) >= 10 and truth.loss > factor * abs(
                statistics.median(healthy[-50:])):
            return step
        healthy.append(truth.loss)
    return None
