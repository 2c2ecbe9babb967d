"""The step guard as the server tells it, on real bf16 training with Adam and no scaler:
a gradient turned inf in fc2 at one step and a batch whose targets are 1000x too large at
another. The truth (which steps, which layer, whether the weights stayed finite) is the
test's own: its gradient hook, its batches and its own reading of the weights."""

from __future__ import annotations

import math
import uuid

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.diagnosis.scenarios import Mlp
from tests.utils import WAIT

# the spike after the server's 50-step spike reference (its pre-check starts there)
STEPS, POISON, SPIKE = 80, 8, 60


def test_guarded_steps_are_stored_skipped_with_their_reason_and_the_incident_says_so(
        server) -> None:
    model = Mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    poison = {"on": False}
    model.fc2.weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    run_id = f"guard-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, run=run_id, server=server.url, flush_interval=0.2,
                              guard={"skip_spikes": 20})
    gen = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen) * 0.1
        if i == SPIKE:
            y = y * 1000.0
        poison["on"] = i == POISON
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the test's own look
    assert attachment.detach(timeout=30)

    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=30) as api:
        steps = api.get(f"/runs/{run_id}/steps").json()["items"]
        findings = api.get(f"/runs/{run_id}/findings", params=WAIT).json()["items"]
        incidents = api.get(f"/runs/{run_id}/incidents", params=WAIT).json()["items"]
        run = api.get(f"/runs/{run_id}", params=WAIT).json()
    assert len(steps) == STEPS
    assert [(s["step"], s["skipped"], s["guarded"]) for s in steps if s["skipped"]] == [
        (POISON, True, "nonfinite_grads"), (SPIKE, True, "loss_spike")]
    assert run["skipped"] == 2

    (nonfinite,) = [f for f in findings if f["kind"] == "nonfinite"]
    assert (nonfinite["step"], nonfinite["layer"]) == (POISON, "fc2")
    assert nonfinite["severity"] != "critical"  # nothing reached the weights
    assert nonfinite["evidence"]["guarded_steps"] == 1
    assert "guard left out 1 of these steps" in nonfinite["message"]
    (spike,) = [f for f in findings if f["kind"] == "loss_spike"]
    assert spike["step"] == SPIKE and spike["evidence"]["guarded_steps"] == 1
    assert f"guard left out step {SPIKE}" in spike["message"]

    told = [i for i in incidents if nonfinite["id"] in i["findings"]]
    assert len(told) == 1 and "guard left out 1 step" in told[0]["headline"]
