"""The forward is the modules that ran, whatever the loop called.

A LightningModule's `training_step` calls `self.net(x)` and never its own `forward`;
other loops call two submodules one after the other, or the model through
`functools.partial` or `torch.func.functional_call`. In each, a weight blown up at known
steps overflows fp16: the first non-finite layer, the forward flag, the autocast dtype
and the sampled activations must be there on every step, as the test's own forward hooks
saw them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch.agent.layers import discover_layers
from tests.agent.factories import batches, spooled_steps

BAD_STEPS = (3, 6)


class Net(nn.Module):
    """A root whose own forward the loop never calls (a LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.decoder = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))
        self.loss_fn = nn.MSELoss()  # called by the loop too: no parameters, not a forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


CALLS: dict[str, Callable[[Net, torch.Tensor], torch.Tensor]] = {
    "self.net(x)": lambda m, x: nn.Sequential(m.encoder, m.decoder)(x),
    "two submodules": lambda m, x: m.decoder(m.encoder(x)),
    "functools.partial": lambda m, x: functools.partial(m)(x),
    "torch.func.functional_call": lambda m, x: torch.func.functional_call(
        m, dict(m.named_parameters()), (x,)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_first_bad_layer_flags_and_dtype_whatever_the_loop_calls(call: str, attach,
                                                                   offline: Path) -> None:
    model = Net()
    if call == "self.net(x)":  # the LightningModule's `self.net`: one child, one call
        model.net = nn.Sequential(model.encoder, model.decoder)
        forward = lambda m, x: m.net(x)  # noqa: E731
    else:
        forward = CALLS[call]
    layers = discover_layers(model)
    first_bad: dict[int, int | None] = {}
    step = {"i": 0}

    def reference(index: int, out: torch.Tensor) -> None:
        if first_bad.get(step["i"]) is None and not bool(torch.isfinite(out).all()):
            first_bad[step["i"]] = index

    handles = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: reference(i, out)) for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=100, sample_after_anomaly=0)
    blown = model.encoder[2]
    for i, (x, y) in enumerate(batches(8)):
        step["i"] = i
        with torch.no_grad():
            blown.weight.mul_(1e6 if i in BAD_STEPS else 1e-6 if i - 1 in BAD_STEPS else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss_fn(forward(model, x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    attachment.detach()
    steps = spooled_steps(offline, attachment.run_id)
    assert {i for i, layer in first_bad.items() if layer is not None} == set(BAD_STEPS)
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == \
        {i: first_bad.get(i) for i in range(8)}
    # a healthy step between samples is judged by its loss: not read, so not stated
    assert [s["forward_nonfinite"] is True for s in steps] == [i in BAD_STEPS for i in range(8)]
    assert {s["autocast_dtype"] for s in steps} == {"float16"}
    assert [s["step"] for s in steps if "activations" in s] == [0]
    assert "weight_norm" in steps[0]["spikes"]  # sampled: the weights' norms too
