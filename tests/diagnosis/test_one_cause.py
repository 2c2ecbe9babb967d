"""One cause, one incident (issue 49): clipping the scaled gradients before `unscale_`
makes the update Adam sees loss-scale times smaller, so eps dominates every layer. Real
fp16 + GradScaler training on the CPU; the truth is the optimizer's own state (the share
of each layer's elements whose sqrt(v_hat) is under eps). The pitfall and every layer's
optimizer state are one incident, not one per layer.
"""

from __future__ import annotations

import uuid

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.conftest import LiveServer
from tests.diagnosis.test_weight_causes import LAYERS, GeluMlp
from tests.utils import WAIT

EPS_SHARE = 0.5  # the server's default adam_eps_share


def _eps_shares(model: nn.Module, optimizer: torch.optim.Adam) -> dict[str, float]:
    group = optimizer.param_groups[0]
    out = {}
    for name in LAYERS:
        under = total = 0
        for p in getattr(model, name).parameters():
            state = optimizer.state[p]
            v_hat = state["exp_avg_sq"] / (1 - group["betas"][1] ** float(state["step"]))
            under += int((v_hat.sqrt() < group["eps"]).sum())
            total += p.numel()
        out[name] = under / total
    return out


def test_clipping_before_unscale_is_one_incident_with_its_optimizer_states(
        server: LiveServer) -> None:
    model = GeluMlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-6)  # HF's default eps
    scaler = torch.amp.GradScaler("cpu")
    run_id = f"clip-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, scaler, run=run_id, server=server.url, flush_interval=0.2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(80):
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 8, generator=gen) * 0.1
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # the pitfall: still scaled
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=30)
    shares = _eps_shares(model, optimizer)
    starved = {name for name in LAYERS if shares[name] >= EPS_SHARE}
    assert len(starved) >= 2, shares  # the truth: eps dominates several layers
    findings = httpx.get(f"{server.url}/api/v1/runs/{run_id}/findings",
                         params={"limit": 1000, **WAIT}, timeout=60).json()["items"]
    states = [f for f in findings if f["kind"] == "optimizer_state"]
    assert {f["layer"] for f in states} <= starved and len(states) >= 2, findings
    pitfall = next(f for f in findings if f["code"] == "clip_before_unscale")
    assert {f["incident"] for f in states} == {pitfall["incident"]}
    incidents = httpx.get(f"{server.url}/api/v1/runs/{run_id}/incidents",
                          params=WAIT, timeout=60).json()["items"]
    serious = [i for i in incidents if i["severity"] != "info"]
    assert [i["id"] for i in serious] == [pitfall["incident"]], serious
