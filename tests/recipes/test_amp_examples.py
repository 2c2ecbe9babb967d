"""Every recipe of PyTorch's "Automatic Mixed Precision examples" page that runs on a CPU,
written as the page writes it, with fp16 autocast and `GradScaler("cpu")`: the typical
loop, clipping after `unscale_`, gradient accumulation, gradient penalty, several models,
losses and optimizers with one scaler, and a custom autograd Function."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.amp import custom_bwd, custom_fwd

from tests.recipes.models import STEPS, batches, mlp
from tests.recipes.truth import Truth, check
from tests.recipes.watch import recipe, watch

loss_fn = nn.MSELoss()
MAX_NORM = 0.5


def grad_norm(model: nn.Module) -> float:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()


def test_typical(client, recipe_server) -> None:
    r = recipe(mlp(0), recipe_server.url, "typical")
    for x, y in batches():
        r.fp16_step(x, y)
    assert r.run.detach(timeout=30)
    check(client, r.run.run_id, r.truth)


def test_clipping_after_unscale(client, recipe_server) -> None:
    """The stored grad norm is the norm before clipping (what clip_grad_norm_ returns);
    `grad_norm_clipped` the norm the optimizer stepped with."""
    r = recipe(mlp(1), recipe_server.url, "clipping")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    before = []
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        truth.backprop(loss)
        scaler.unscale_(optimizer)
        before.append(grad_norm(model))
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    stored = list(client.steps(run.run_id))
    assert any(norm > MAX_NORM for norm in before)  # the clip did clip
    for record, step, norm in zip(stored, truth.steps, before, strict=True):
        if not step.skipped:
            assert math.isclose(record.grad_norm_clipped, step.grad_norm, rel_tol=1e-3)
            step.grad_norm = norm
    check(client, run.run_id, truth)


def test_gradient_accumulation(client, recipe_server) -> None:
    r = recipe(mlp(2), recipe_server.url, "accumulation")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    iters_to_accumulate = 3
    for i, (x, y) in enumerate(batches(STEPS * iters_to_accumulate)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y) / iters_to_accumulate
        scaler.scale(loss).backward()
        truth.backprop(loss)
        if (i + 1) % iters_to_accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


def test_gradient_penalty(client, recipe_server) -> None:
    """`autograd.grad` of the scaled loss, then the scaled loss + penalty backpropagated:
    the step's loss is loss + penalty, the one loss backpropagated."""
    r = recipe(mlp(3), recipe_server.url, "gradient-penalty")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss),
                                                 inputs=model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with torch.autocast("cpu", dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        truth.backprop(loss)
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


INF_IN_MODEL1 = 6


def test_several_models_losses_and_optimizers(client, recipe_server) -> None:
    """Both losses reach model0: its step's loss is loss0 + loss1. An inf in model1's
    grads skips model1's step only and halves the shared scale: nothing of model0's."""
    model0, model1 = mlp(4), mlp(5)
    optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.05)
    optimizer1 = torch.optim.SGD(model1.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    truth = Truth(model0, optimizer0, scaler)
    poison = {"on": False}
    model1[0].weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    run = watch(model0, scaler, recipe_server.url, "several-models", optimizer=optimizer0)
    for i, (x, y) in enumerate(batches()):
        poison["on"] = i == INF_IN_MODEL1
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output0 = model0(x)
            output1 = model1(x)
            loss0 = loss_fn(2 * output0 + 3 * output1, y)
            loss1 = loss_fn(3 * output0 - 5 * output1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        truth.backprop(loss0)
        truth.backprop(loss1)
        scaler.unscale_(optimizer0)  # e.g. to clip model0's grads
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)
    assert truth.steps[INF_IN_MODEL1 + 1].loss_scale == truth.steps[INF_IN_MODEL1].loss_scale / 2


class MyMM(torch.autograd.Function):
    """The page's custom Function: runs in float32 under autocast (`cast_inputs`)."""

    @staticmethod
    @custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.fc = nn.Linear(16, 32)
        self.weight = nn.Parameter(torch.randn(32, 8) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MyMM.apply(torch.relu(self.fc(x)), self.weight)


def test_custom_autograd_function(client, recipe_server) -> None:
    r = recipe(WithCustomFunction(), recipe_server.url, "custom-function")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            assert out.dtype == torch.float32
            loss = loss_fn(out, y)
        scaler.scale(loss).backward()
        truth.backprop(loss)
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)
