"""Zero gradients called fp16 underflow only when fp16 made them (issue 49): fp16 autocast
+ GradScaler, real CPU training. The truth is the test's own: on sampled steps it counts
each layer's exact-zero gradient elements, then replays the same step (same weights, same
batch) in fp32 without a scaler and counts again. Zeros that fp32 makes too are the
model's (GELUs saturated at -1000); zeros fp32 does not make are underflow.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.conftest import LiveServer
from tests.diagnosis.test_weight_causes import LAYERS, GeluMlp
from tests.utils import WAIT

ZERO_SHARE = 0.5  # the server's default underflow_zero_share


def _zero_shares(model: nn.Module) -> dict[str, float]:
    out = {}
    for name in LAYERS:
        grads = [p.grad for p in getattr(model, name).parameters() if p.grad is not None]
        if grads:
            out[name] = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
    return out


def _train(server: str, steps: int, scaler_kwargs: dict, loss_factor: float,
           fault: Callable[[int, nn.Module], None]) -> tuple[str, list[tuple[dict, dict]]]:
    """Adam, fp16 + GradScaler; the truth on every 10th step: (fp16 zero shares, fp32
    replay's zero shares)."""
    model = GeluMlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    run_id = f"zeros-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, scaler, run=run_id, server=server, flush_interval=0.2)
    assert attachment.enabled
    gen = torch.Generator().manual_seed(1)
    truth = []
    for step in range(steps):
        fault(step, model)
        x = torch.randn(32, 16, generator=gen)
        y = torch.randn(32, 8, generator=gen) * 0.1
        replay = copy.deepcopy(model) if step % 10 == 0 else None
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y) * loss_factor
        scaler.scale(loss).backward()
        if replay is not None:
            (nn.functional.mse_loss(replay(x), y) * loss_factor).backward()
            truth.append((_zero_shares(model), _zero_shares(replay)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=30)
    return run_id, truth


def _zeros_findings(server: str, run_id: str) -> list[dict]:
    answer = httpx.get(f"{server}/api/v1/runs/{run_id}/findings", params={"limit": 1000, **WAIT},
                       timeout=60)
    answer.raise_for_status()
    return [f for f in answer.json()["items"] if f["kind"] == "underflow_risk"]


def _saturate_fc2_at_40(step: int, model: nn.Module) -> None:
    """48 of fc2's 64 units pushed to -1000 before their GELU: it outputs exactly 0 there
    and passes back exactly 0, in any precision (the saturated units of a blow-up)."""
    if step == 40:
        with torch.no_grad():
            model.fc2.bias[:48] -= 1e3


def test_zeros_of_saturated_activations_are_not_called_underflow(server: LiveServer) -> None:
    run_id, truth = _train(server.url, 120, {}, 1.0, _saturate_fc2_at_40)
    late = truth[5:]  # steps 50 on
    model_zeros = {name for name in LAYERS
                   if sum(fp16[name] >= ZERO_SHARE and fp32[name] >= ZERO_SHARE
                          for fp16, fp32 in late) > len(late) / 2}
    assert model_zeros, "the blow-up was meant to saturate the GELUs"
    found = _zeros_findings(server.url, run_id)
    assert found, "today's code calls these zeros underflow; they must be seen"
    assert {f["layer"] for f in found} <= model_zeros
    assert {(f["severity"], f["code"]) for f in found} == {("info", "model_zeros")}
    assert all("not from fp16 underflow" in f["message"] for f in found)


def test_tiny_gradients_at_a_low_scale_are_underflow(server: LiveServer) -> None:
    low = {"init_scale": 2.0**-8, "growth_interval": 10**6}
    run_id, truth = _train(server.url, 60, low, 1e-4, lambda step, model: None)
    flushed = {name for name in LAYERS
               if sum(fp16[name] >= ZERO_SHARE and fp32[name] < 0.05
                      for fp16, fp32 in truth) > len(truth) / 2}
    assert flushed, "the low scale was meant to flush the gradients"
    found = _zeros_findings(server.url, run_id)
    assert {f["layer"] for f in found} == flushed
    assert {(f["severity"], f["code"]) for f in found} == {("warning", None)}
