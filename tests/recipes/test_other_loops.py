"""Everyday loops beyond the AMP examples page: knowledge distillation from a frozen
teacher, an EMA copy updated every step, two optimizers sharing one model's parameters,
a closure optimizer (LBFGS), a multi-task model with two heads, and a loss the loop
names itself with `log_loss`."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.recipes.models import STEPS, TwoHeads, batches, mlp
from tests.recipes.truth import Truth, check
from tests.recipes.watch import recipe, watch


def test_distillation_from_a_frozen_teacher(client, recipe_server) -> None:
    teacher, student = mlp(20).requires_grad_(False).eval(), mlp(21)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    truth = Truth(student, optimizer, scaler)
    run = watch(student, scaler, recipe_server.url, "distillation")
    for x, y in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.no_grad():
                soft = teacher(x)
            out = student(x)
            loss = 0.5 * F.mse_loss(out, y) + 0.5 * F.kl_div(
                F.log_softmax(out.float(), -1), F.softmax(soft.float(), -1),
                reduction="batchmean")
        scaler.scale(loss).backward()
        truth.backprop(loss)
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


def test_ema_copy_updated_every_step(client, recipe_server) -> None:
    """The EMA copy is made after attach (a deep copy of the watched model, hooks and
    all) and runs its own evaluation forwards under autocast."""
    r = recipe(mlp(22), recipe_server.url, "ema")
    model, truth, run = r.model, r.truth, r.run
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for x, y in batches():
        r.fp16_step(x, y)
        ema.update_parameters(model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            ema(x)
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)
    assert not any(s.eval_forwards for s in client.steps(run.run_id))  # the copy's are its own


def test_two_optimizers_on_one_model(client, recipe_server) -> None:
    """Param groups split across two optimizers (one scaler), as actor-critic and GAN
    codes do: the step is the first optimizer's, its grad norm the whole model's,
    unscaled."""
    model = mlp(23)
    first = torch.optim.SGD(model[0].parameters(), lr=0.05)
    second = torch.optim.Adam(model[2].parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    truth = Truth(model, second, scaler)  # by the last step, every grad is unscaled
    run = watch(model, scaler, recipe_server.url, "two-optimizers", optimizer=first)
    for x, y in batches():
        first.zero_grad()
        second.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        truth.backprop(loss)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


def test_lbfgs_closure(client, recipe_server) -> None:
    """bf16 (a GradScaler does not take closures); the step's loss and grads are the
    closure's first evaluation, the later ones are LBFGS's line search."""
    model = mlp(24)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    truth = Truth(model, None)
    run = watch(model, None, recipe_server.url, "lbfgs")
    for x, y in batches(STEPS // 2):
        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            if truth.current.grad_norm is None:
                truth.backprop(loss)
                truth.stepped()
            return loss

        optimizer.step(closure)
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


def test_multi_task_two_heads(client, recipe_server) -> None:
    """Two losses, one per head, each backpropagated: the step's loss is their sum."""
    r = recipe(TwoHeads(), recipe_server.url, "two-heads")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    gen = torch.Generator().manual_seed(7)
    for x, y in batches():
        labels = torch.randint(0, 8, (8,), generator=gen)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            regressed, logits = model(x)
            loss_regress = F.mse_loss(regressed, y)
            loss_classify = F.cross_entropy(logits, labels)
        scaler.scale(loss_regress).backward(retain_graph=True)
        scaler.scale(loss_classify).backward()
        truth.backprop(loss_regress)
        truth.backprop(loss_classify)
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)


def test_log_loss_names_the_loss(client, recipe_server) -> None:
    """A loop that backpropagates loss + an auxiliary term but wants the main loss
    stored names it: `log_loss` replaces what the agent saw."""
    r = recipe(mlp(25), recipe_server.url, "log-loss")
    model, optimizer, scaler, truth, run = r.model, r.optimizer, r.scaler, r.truth, r.run
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = F.mse_loss(out, y)
            aux = 0.1 * out.float().pow(2).mean()
        scaler.scale(loss + aux).backward()
        truth.backprop(loss)
        run.log_loss(loss if i % 2 else float(loss.detach()))  # a tensor, or a number
        scaler.step(optimizer)
        scaler.update()
        truth.end_step()
    assert run.detach(timeout=30)
    check(client, run.run_id, truth)
