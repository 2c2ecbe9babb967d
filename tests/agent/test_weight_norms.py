"""The weight norms (agent/collectors/weights.py) against the truth: the test's own norm of
each layer's own parameters as each sampled step's forward begins; tied parameters count
once, in the first layer holding them; unsampled steps carry none."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tests.agent.factories import spooled_steps
from tests.agent.test_spike_signals import layer_names, own_params
from tests.spikes.model import VOCAB, TinyLM, batch


def test_weight_norms_are_the_weights_each_sampled_step_ran_with(attach, offline: Path) -> None:
    model = TinyLM()
    model.head.weight = model.tok.weight  # tied: counted in `tok`, the first holder
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    attachment = attach(model, run="weight-norms", sample_every=2)
    truth = []
    for step in range(5):
        if step == 2:  # the loop rescales a layer's weights: the sample must see it
            with torch.no_grad():
                model.blocks[0].mlp[0].weight.mul_(1e3)
        truth.append({name: math.sqrt(sum(float(p.detach().double().square().sum())
                                          for p in params))
                      for name, params in own_params(model).items()})
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    names = layer_names(model)
    steps = spooled_steps(offline, "weight-norms")
    sampled = {s["step"]: s["spikes"]["weight_norm"] for s in steps
               if "weight_norm" in s.get("spikes", {})}
    assert sorted(sampled) == [0, 2, 4]
    for step, norms in sampled.items():
        for i, name in enumerate(names):
            if name in truth[step]:
                assert norms[i] == pytest.approx(truth[step][name], rel=1e-5), (step, name)
            else:
                assert norms[i] is None, name  # no parameters of its own
    fc = names.index("blocks.0.mlp.0")
    assert sampled[2][fc] > 500 * sampled[0][fc]
