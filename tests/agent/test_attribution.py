"""Which backward is the watched model's (agent/attribution.py): the graph walk and the
map from scaled to unscaled losses. The loops themselves are in tests/recipes/."""

from __future__ import annotations

import torch
from torch import nn

from ampwatch.agent.attribution import BackwardOwner, ScaledLosses, reaches_params
from tests.agent.factories import mlp


def ids(model: nn.Module) -> set[int]:
    return {id(p) for p in model.parameters()}


def test_a_loss_reaches_the_models_whose_parameters_it_writes() -> None:
    G, D = mlp(0), mlp(1)
    fake = G(torch.randn(2, 16))
    mixed = torch.cat([fake, torch.randn(2, 12)], dim=1)  # a batch for D
    loss_d = D(mixed.detach()).sum()  # a discriminator's loss on a detached fake
    loss_g = D(mixed).sum()  # the generator's loss, through the discriminator
    assert reaches_params(loss_d, ids(D)) and not reaches_params(loss_d, ids(G))
    assert reaches_params(loss_g, ids(G)) and reaches_params(loss_g, ids(D))
    D.requires_grad_(False)  # frozen while G steps: its grads are not written
    assert not reaches_params(D(mixed).sum(), ids(D))
    weight = G[0].weight
    assert reaches_params(weight, ids(G))  # backward() on a parameter itself


def test_a_graph_past_the_limit_counts_as_the_models() -> None:
    D = mlp(1)
    h = torch.randn(2, 16, requires_grad=True)
    for _ in range(50):
        h = h * 1.01
    foreign = D(h).sum()
    model = mlp(2)
    assert not reaches_params(foreign, ids(model))
    assert reaches_params(foreign, ids(model), limit=20)  # too much rather than too little


def test_scaled_losses_map_back_to_their_loss_once() -> None:
    scaled = ScaledLosses()
    loss, other = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    out, out_other = loss * 4, other * 4
    scaled.note(loss, out)
    scaled.note(other, out_other)
    assert scaled.pop(out).item() == 2.0 and scaled.pop(out) is None
    assert scaled.latest().item() == 3.0 and scaled.latest() is None
    scaled.note(loss, out)
    scaled.clear()
    assert scaled.pop(out) is None


def test_the_owner_claims_its_models_backward_with_the_unscaled_loss() -> None:
    G, D = mlp(0), mlp(1)
    owner = BackwardOwner(ids(G), parallelism=None)
    owner.forward_ran()
    loss_g = G(torch.randn(2, 16)).sum()
    scaled = loss_g * 1024
    owner.scaled.note(loss_g, scaled)
    ours, loss = owner.claim(scaled, scaler_enabled=True)
    assert ours and loss.item() == loss_g.item()
    assert owner.claim(D(torch.randn(2, 16)).sum(), scaler_enabled=True) == (False, None)
    owner.step_ended()  # G has not run since its step: nothing backpropagated now is G's
    assert owner.claim(D(torch.randn(2, 16)).sum(), scaler_enabled=True) == (False, None)
    fsdp = BackwardOwner(ids(G), parallelism="fsdp2")  # no walk: every backward counts
    assert fsdp.claim(D(torch.randn(2, 16)).sum(), scaler_enabled=False)[0]
