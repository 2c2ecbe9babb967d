"""A layer's weights as the cause (issue 49): fp16 autocast + GradScaler, a 4-Linear GELU
MLP trained for real on the CPU, with fc2's weights rescaled by the loop. The truth is the
test's own: the weights' norms it reads itself before each step's forward, and its own
forward hooks' abs-max of every layer's output. The finding that names the cause names
fc2, on the step the weights moved, not the head that its larger outputs push up.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.conftest import LiveServer
from tests.utils import WAIT

LAYERS = ("fc1", "fc2", "fc3", "head")


class GeluMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 64)
        self.fc3, self.head = nn.Linear(64, 64), nn.Linear(64, 8)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))))


def _train(server: str, steps: int, fault: Callable[[int, nn.Module], None]
           ) -> tuple[str, list[dict[str, float]], list[dict[str, float]]]:
    """fp16 + GradScaler, Adam; per step the truth: each layer's weight norm as the forward
    begins and its output's abs-max."""
    model = GeluMlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    absmax: dict[str, float] = {}
    for name in LAYERS:
        getattr(model, name).register_forward_hook(
            lambda m, a, out, name=name: absmax.__setitem__(name, float(out.detach().abs()
                                                                         .float().max())))
    run_id = f"weights-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, scaler, run=run_id, server=server, flush_interval=0.2)
    assert attachment.enabled
    gen = torch.Generator().manual_seed(1)
    norms, outputs = [], []
    for step in range(steps):
        fault(step, model)
        norms.append({name: float(torch.linalg.vector_norm(torch.cat(
            [p.detach().flatten() for p in getattr(model, name).parameters()])))
            for name in LAYERS})
        x = torch.randn(32, 16, generator=gen)
        y = torch.randn(32, 8, generator=gen) * 0.1
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        outputs.append(dict(absmax))
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=30)
    return run_id, norms, outputs


def _findings(server: str, run_id: str, what: str = "findings") -> list[dict]:
    answer = httpx.get(f"{server}/api/v1/runs/{run_id}/{what}", params={"limit": 1000, **WAIT},
                       timeout=30)
    answer.raise_for_status()
    return answer.json()["items"]


def _rescale_fc2_at_40(step: int, model: nn.Module) -> None:
    if step == 40:
        with torch.no_grad():
            model.fc2.weight.mul_(1e4)


def _grow_fc2(step: int, model: nn.Module) -> None:
    with torch.no_grad():
        model.fc2.weight.mul_(1.05)


def test_weights_rescaled_by_the_loop_are_named_on_their_layer(server: LiveServer) -> None:
    run_id, norms, outputs = _train(server.url, 60, _rescale_fc2_at_40)
    # the truth: fc2's own weights and output jumped at step 40, the other layers' weights
    # did not; what follows fc2 grew with it
    for name in LAYERS:
        jump = norms[40][name] / norms[39][name]
        assert (jump > 1000) if name == "fc2" else (0.9 < jump < 1.1), (name, jump)
    assert outputs[40]["fc2"] > 1000 * outputs[39]["fc2"]
    assert outputs[40]["head"] > 100 * outputs[39]["head"]
    items = _findings(server.url, run_id)
    jumps = [f for f in items if f["kind"] == "weight_jump"]
    assert [(f["layer"], f["code"], f["step"], f["severity"]) for f in jumps] == [
        ("fc2", "weight_jump", 40, "critical")]
    evidence = jumps[0]["evidence"]
    assert (evidence["before_step"], evidence["jump_step"]) == (30, 40)
    assert evidence["factor"] > 1000
    # nothing names a layer before the cause, and no finding starts before step 40
    serious = [f for f in items if f["severity"] != "info"]
    assert all(f["step"] is not None and f["step"] >= 40 for f in serious), items
    # one story: what the larger weights did downstream (head's overflow, the scaler, the
    # loss spike) is fc2's incident, its title the layer and the step the weights moved
    incidents = [i for i in _findings(server.url, run_id, "incidents")
                 if i["severity"] != "info"]
    assert len(incidents) == 1, [(i["cause"], i["layer"], i["findings"]) for i in incidents]
    (incident,) = incidents
    assert (incident["cause"], incident["layer"], incident["step"]) == ("weight_jump", "fc2", 40)
    assert incident["headline"] == "Layer 'fc2''s weights jumped at step 40"
    assert {f["id"] for f in serious} <= set(incident["findings"])
    assert "precision is not the cause" in incident["fix"]
    spike = [f for f in items if f["kind"] == "loss_spike"]
    assert [(f["code"], f["layer"]) for f in spike] in ([], [("weight_jump", "fc2")])


def test_a_growing_layer_is_named_where_the_growth_starts(server: LiveServer) -> None:
    run_id, norms, outputs = _train(server.url, 220, _grow_fc2)
    # the truth: fc2's weights and output grow ~5% a step from step 0; the others barely
    assert norms[70]["fc2"] > 20 * norms[0]["fc2"]
    assert all(norms[70][name] < 1.5 * norms[0][name] for name in ("fc1", "fc3", "head"))
    assert outputs[70]["fc2"] > 20 * outputs[0]["fc2"]
    # ... until what follows fc2 breaks: head's gradients overflow fp16 long before fc2's
    # own output nears fp16's maximum
    assert max(o["fc2"] for o in outputs[:150]) < 65504 / 2
    items = _findings(server.url, run_id)
    named = [(f["layer"], f["code"], f["step"], f["severity"]) for f in items
             if f["kind"] == "weight_jump"]
    # where the growth starts (info on its own: a growth alone may be harmless)
    assert named == [("fc2", "weight_growth", 0, "info")]
    downstream = [f for f in items if f["severity"] != "info"]
    assert downstream and all(f["layer"] in (None, "fc2", "fc3", "head") for f in downstream)
    # one story, told from where it starts: what broke downstream is fc2's growth's
    # incident, so the top card names fc2 and says the precision is not the cause
    incidents = [i for i in _findings(server.url, run_id, "incidents")
                 if i["severity"] != "info"]
    assert len(incidents) == 1, [(i["cause"], i["layer"], i["findings"]) for i in incidents]
    (incident,) = incidents
    assert (incident["cause"], incident["layer"], incident["step"]) == ("weight_jump", "fc2", 0)
    assert incident["headline"] == "Layer 'fc2''s weights grew from step 0"
    assert {f["id"] for f in downstream} <= set(incident["findings"])
    assert "precision is not the cause" in incident["fix"]
    assert "fp32" not in incident["fix"] and "bf16" not in incident["fix"]
