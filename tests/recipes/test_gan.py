"""A GAN as DCGAN writes it (discriminator step, then generator step), fp16 autocast, with
one scaler shared by both optimizers or one scaler each; watching G, D, or both as two
runs, with a fault in the model that is not watched, and a slow backward in D's loss
only (whose time it is shows in `t_backward_ms`). G's backward runs through D (and
writes D's grads, which D's next `zero_grad` drops); D's backward never reaches G (the
fake batch is detached)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce

from tests.recipes.models import STEPS, WIDTH, batches, mlp
from tests.recipes.truth import Truth, check
from tests.recipes.watch import watch

NAN_IN_REAL = 5  # a NaN in the real batch of this step: D's loss and grads are NaN
INF_IN_G = 7  # an inf in G's grads at this step: G's step is skipped
D_BACKWARD_S = 0.03  # D's loss takes this long to backpropagate: whose time is it?


class SlowBackward(torch.autograd.Function):
    """Identity; its backward sleeps, so a backward that includes it is long."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(D_BACKWARD_S)
        return grad


def timed_backward(tensor: torch.Tensor) -> float:
    """Backpropagate `tensor`; the milliseconds the call took, as the loop sees them."""
    start = time.perf_counter()
    tensor.backward()
    return (time.perf_counter() - start) * 1000


def gan_loop(G: nn.Module, D: nn.Module, oG: torch.optim.Optimizer, oD: torch.optim.Optimizer,
             scalers: tuple[torch.amp.GradScaler, torch.amp.GradScaler],
             truth_g: Truth | None, truth_d: Truth | None, fault: str,
             data: list | None = None, start: int = 0) -> None:
    scaler_d, scaler_g = scalers
    poison = {"on": False}
    G[-1].weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    for i, (real, _) in enumerate(data or batches(STEPS, seed=2), start=start):
        if fault == "D" and i == NAN_IN_REAL:
            real = real.clone()
            real[0, 0] = math.nan
        poison["on"] = fault == "G" and i == INF_IN_G
        z = torch.randn(8, 8)
        D.zero_grad()  # DCGAN's netD.zero_grad(): the module's, not the optimizer's
        if truth_d:
            truth_d.forget()  # G's last backward wrote D's grads; they are dropped here
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            d_real, d_fake = D(real), D(fake.detach())
            loss_d = SlowBackward.apply(
                bce(d_real.float(), torch.ones_like(d_real, dtype=torch.float32))
                + bce(d_fake.float(), torch.zeros_like(d_fake, dtype=torch.float32)))
        took = timed_backward(scaler_d.scale(loss_d))
        if truth_d:
            truth_d.backprop(loss_d, took)
        scaler_d.step(oD)
        if truth_d:
            truth_d.end_step()
        if scaler_d is not scaler_g:
            scaler_d.update()
        oG.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = D(fake)
            loss_g = bce(out.float(), torch.ones_like(out, dtype=torch.float32))
        took = timed_backward(scaler_g.scale(loss_g))
        if truth_g:
            truth_g.backprop(loss_g, took)
        if truth_d:
            truth_d.backprop(loss_g, took)  # it wrote D's grads too, until D.zero_grad()
        scaler_g.step(oG)
        scaler_g.update()
        if truth_g:
            truth_g.end_step()


def generator() -> nn.Module:
    return mlp(10, inputs=8, outputs=WIDTH)


def discriminator() -> nn.Module:
    return mlp(11, outputs=1)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_scaler", "two_scalers"])
@pytest.mark.parametrize("watched", ["G", "D", "both"])
def test_gan(client, recipe_server, shared: bool, watched: str) -> None:
    G, D = generator(), discriminator()
    oG = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    oD = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    scaler_g = torch.amp.GradScaler("cpu")
    scaler_d = scaler_g if shared else torch.amp.GradScaler("cpu")
    fault = {"G": "D", "D": "G", "both": "D"}[watched]
    runs = {}
    truth_g = truth_d = None
    if watched in ("G", "both"):
        truth_g = Truth(G, oG, scaler_g)
        runs["G"] = watch(G, scaler_g, recipe_server.url, "gan-g", optimizer=oG)
    if watched in ("D", "both"):
        truth_d = Truth(D, oD, scaler_d)
        runs["D"] = watch(D, scaler_d, recipe_server.url, "gan-d", optimizer=oD)
    gan_loop(G, D, oG, oD, (scaler_d, scaler_g), truth_g, truth_d, fault)
    for attachment in runs.values():
        assert attachment.detach(timeout=30)
    if truth_g:
        check(client, runs["G"].run_id, truth_g)  # D's NaN is none of G's business
    if truth_d:
        # a NaN input batch is D's own fault, a warning on the skipped step; G's inf is not
        expected = {("nonfinite", None, NAN_IN_REAL, "warning")} if fault == "D" else set()
        check(client, runs["D"].run_id, truth_d, expected)
        # D's own backward is D's: it includes the slow part
        assert all(s.t_backward_ms >= D_BACKWARD_S * 1000 for s in client.steps(runs["D"].run_id))


def test_two_runs_sharing_a_scaler_detach_in_either_order(client, recipe_server) -> None:
    """G's run is detached halfway; D's run goes on with the scaler they shared."""
    G, D = generator(), discriminator()
    oG = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    oD = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cpu")
    truth_g, truth_d = Truth(G, oG, scaler), Truth(D, oD, scaler)
    run_g = watch(G, scaler, recipe_server.url, "gan-g-first", optimizer=oG)
    run_d = watch(D, scaler, recipe_server.url, "gan-d-last", optimizer=oD)
    data = batches(STEPS, seed=2)
    gan_loop(G, D, oG, oD, (scaler, scaler), truth_g, truth_d, "G", data[:INF_IN_G - 2])
    assert run_g.detach(timeout=30)
    gan_loop(G, D, oG, oD, (scaler, scaler), None, truth_d, "G", data[INF_IN_G - 2:],
             start=INF_IN_G - 2)  # G's inf comes while only D is watched
    assert run_d.detach(timeout=30)
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))
    check(client, run_g.run_id, truth_g)
    check(client, run_d.run_id, truth_d)
