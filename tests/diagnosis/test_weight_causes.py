"""A layer's weights as the cause (issue 49): fp16 autocast + GradScaler, a 4-Linear GELU
MLP trained for real on the CPU, with fc2's weights rescaled by the loop. The truth is the
test's own: the weights' norms it reads itself before each step's forward, and its own
forward hooks' abs-max of every layer's output. The finding that names the cause names
fc2, on the step the weights moved, not the head that its larger outputs push up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path

import httpx
import torch
from torch import nn

from ampwatch import agent
from ampwatch.client import Client
from tests.conftest import LiveServer
from tests.utils import WAIT

ROOT = Path(__file__).resolve().parents[2]

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


def _one_story_on_fc2(server: str, run_id: str, step: int, headline: str,
                     serious: list[dict]) -> dict:
    """The run's one incident at warning or worse: fc2's weights from `step`, titled
    `headline`, holding every finding of `serious`, its fix clearing the precision."""
    incidents = [i for i in _findings(server, run_id, "incidents") if i["severity"] != "info"]
    assert len(incidents) == 1, [(i["cause"], i["layer"], i["findings"]) for i in incidents]
    (incident,) = incidents
    assert (incident["cause"], incident["layer"], incident["step"]) == ("weight_jump", "fc2",
                                                                        step)
    assert incident["headline"] == headline
    assert {f["id"] for f in serious} <= set(incident["findings"])
    assert "precision is not the cause" in incident["fix"]
    return incident


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
    _one_story_on_fc2(server.url, run_id, 40, "The weights of layer 'fc2' jumped at step 40",
                      serious)
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
    incident = _one_story_on_fc2(server.url, run_id, 0,
                                 "The weights of layer 'fc2' grew from step 0", downstream)
    assert "fp32" not in incident["fix"] and "bf16" not in incident["fix"]


# --model for `ampwatch replay`: the loop's loss is an MSE against targets the forward never
# sees (0.1-scale noise), so the replay's loss is the mean square of the output
FACTORY = """from tests.diagnosis.test_weight_causes import GeluMlp


def make():
    return GeluMlp(), lambda output, *args, **kwargs: output.float().pow(2).mean()
"""


def _ampwatch(*args: str) -> subprocess.CompletedProcess:
    """The real `ampwatch` console script of this environment, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("AMPWATCH_SERVER", None)
    return subprocess.run(["ampwatch", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


def test_a_bisect_that_clears_the_precision_is_the_fix_everywhere(server: LiveServer,
                                                                   tmp_path: Path) -> None:
    """`ampwatch replay --bisect` of the bundle of step 40, whose bad step no upcast fixes
    (fc2's weights were multiplied by 1e4: the test did it), records its verdict with the
    bundle; the incident's fix then says what the replay found and recommends no upcast,
    in the API and in `ampwatch show` alike."""
    run_id, norms, _ = _train(server.url, 60, _rescale_fc2_at_40)
    assert norms[40]["fc2"] > 1000 * norms[39]["fc2"]  # the truth: the loop did it at 40
    with Client(server.url, timeout=60) as client:
        client.wait_for_analysis(run_id)
        assert 40 in [b.step for b in client.bundles(run_id)]
    factory = tmp_path / "gelu_mlp.py"
    factory.write_text(FACTORY)
    started = datetime.now(UTC)
    done = _ampwatch("replay", "--run", run_id, "--step", "40", "--model", f"{factory}:make",
                     "--bisect", "--server", server.url)
    assert done.returncode == 0, done.stderr  # the bad step fails again
    assert "no upcast fixes this step" in done.stdout
    assert f"verdict recorded on the server with the bundle (run {run_id}, rank 0, step 40)" \
        in done.stdout
    with Client(server.url, timeout=60) as client:
        verdict = next(b.bisect for b in client.bundles(run_id) if b.step == 40)
        incidents = [i for i in client.incidents(run_id) if i.problem]
    assert (verdict.verdict, verdict.modules, verdict.fix) == ("not_precision", [], None)
    assert started - timedelta(seconds=1) <= verdict.ran_at <= verdict.recorded_at
    (incident,) = incidents
    assert (incident.layer, incident.step) == ("fc2", 40)
    ampwatch_version = version("ampwatch")
    assert incident.fix == (
        "Replaying step 40 with every layer in fp32 still fails (ampwatch replay --bisect, "
        f"reported by ampwatch replay {ampwatch_version} on {socket.gethostname()} without "
        "a token, unverified): the cause is not the precision; check the weights of layer "
        "'fc2' and the learning rate, then the data.")
    for upcast in ("bf16", "run it in fp32", "float32", "keep_in_fp32", "KEEP_FP32"):
        assert upcast not in incident.fix
    shown = _ampwatch("show", run_id, "--server", server.url)
    assert shown.returncode == 0, shown.stderr
    assert f"CRITICAL {incident.headline}" in shown.stdout
    assert f"fix: {incident.fix}" in shown.stdout
