"""The FP8 suite's scenario: a small torchao Float8Linear model trained with the agent on a
real server, and the truth from the test's own hooks, which cast each tensor with torchao's
own scale and cast functions and count what the cast lost.

Emulated casts on the CPU (tests/agent/test_fp8.py); real FP8 on a Hopper-class GPU
(`-m cuda` tests and bench/gpu_check.py), where the model runs in bf16 as torch._scaled_mm's
rowwise scaling needs.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.utils import WAIT

SAMPLE_EVERY = 10
FAULT_STEP = 20  # a scheduled sample: the agent measures FP8 casts on sampled steps
STEPS = 36
ROWS = 32
THRESHOLD = 0.01  # the server's default fp8_underflow_share / fp8_saturation_share


class Net(nn.Module):
    def __init__(self, recipe: str, emulate: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 16)
        from torchao import float8  # the report helpers below need no torchao

        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        float8.convert_to_float8_training(
            self, config=dataclasses.replace(config, emulate=emulate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.norm(self.fc1(x))))))


class Truth:
    """Per step, layer and tensor: the abs-max and the elements the real cast lost, from
    the test's own hooks (torchao's scale function and cast, as its Float8Linear calls
    them)."""

    def __init__(self, model: Net) -> None:
        self.step = 0
        self.seen: dict[tuple[int, str, str], dict] = {}
        for name in ("fc1", "fc2", "fc3"):
            module = getattr(model, name)
            module.register_forward_pre_hook(self._pre(name))
            module.register_forward_hook(self._post(name))

    def cast(self, name: str, role: str, tensor: torch.Tensor, module: nn.Module,
             dim: int) -> None:
        from torchao import float8
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import tensor_to_scale

        config = module.config
        cast = {"input": config.cast_config_input, "weight": config.cast_config_weight,
                "grad": config.cast_config_grad_output}[role]
        axiswise = cast.scaling_granularity is float8.ScalingGranularity.AXISWISE
        axis = dim if axiswise else None
        tensor = tensor.detach()
        scale = tensor_to_scale(tensor, cast.target_dtype, False, None,
                                cast.scaling_granularity, axis,
                                config.round_scales_to_power_of_2)
        bits = hp_tensor_and_scale_to_float8(tensor, scale, cast.target_dtype, None,
                                             axiswise_dim=axis)._data
        self.seen[(self.step, name, role)] = {
            "amax": float(tensor.abs().max()),
            "scale": float(scale.float().amin()),
            "underflow": int(((bits.float() == 0) & (tensor != 0)).sum()) / tensor.numel(),
        }

    def _pre(self, name: str):
        def hook(module, args):
            if module.training:
                self.cast(name, "input", args[0], module, -1)
                self.cast(name, "weight", module.weight.t(), module, 0)
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            if module.training:
                step = self.step
                output.register_hook(lambda grad: self._grad(name, module, grad, step))
        return hook

    def _grad(self, name, module, grad, step) -> None:
        current, self.step = self.step, step
        self.cast(name, "grad", grad.reshape(-1, grad.shape[-1]), module, -1)
        self.step = current


def train(server: Any, recipe: str, *, outlier_from: int | None,
          device: torch.device | None = None, weight_outlier_at: int | None = None
          ) -> tuple[str, Truth]:
    """Train `STEPS` steps with the agent sending to `server` (anything with a `.url`):
    emulated FP8 in float32 on the CPU, real FP8 in bf16 on CUDA. `outlier_from`: an input
    element of 1e6 from that step on; `weight_outlier_at`: one of fc2's weights set to 1e4
    as that step begins. Returns the run id and the truth."""
    device = device or torch.device("cpu")
    real = device.type == "cuda"
    model = Net(recipe, emulate=not real).to(device, torch.bfloat16 if real else torch.float32)
    truth = Truth(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    run = f"fp8-{recipe}-{uuid.uuid4().hex[:8]}"
    with agent.attach(model, run=run, server=server.url, sample_every=SAMPLE_EVERY) as watch:
        for step in range(STEPS):
            truth.step = step
            if step == weight_outlier_at:
                with torch.no_grad():
                    model.fc2.weight[0, 0] = 1e4  # sets the tensorwise scale of fc2's weight
            x, y = torch.randn(ROWS, 64, generator=gen), torch.randn(ROWS, 16, generator=gen)
            x, y = x.to(device, dtype), y.to(device, dtype)
            if outlier_from is not None and step >= outlier_from:
                x[0, 0] = 1e6  # one element sets the tensorwise scale of fc1's input
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert watch.flush(timeout=30)
    return run, truth


def fp8_report(server: Any, run: str) -> dict:
    answer = httpx.get(f"{server.url}/api/v1/runs/{run}/fp8",
                       params={"buckets": 10_000, **WAIT}, timeout=60)
    answer.raise_for_status()
    return answer.json()


def severe_findings(server: Any, run: str) -> set[tuple[str, str | None, int | None]]:
    items = httpx.get(f"{server.url}/api/v1/runs/{run}/findings", params=WAIT,
                      timeout=60).json()["items"]
    return {(f["kind"], f["layer"], f["step"], f["evidence"].get("tensor")) for f in items
            if f["severity"] in ("warning", "critical")}


def observed_shares(report: dict, name: str) -> dict[tuple[int, str, str], float]:
    out = {}
    for row, label in enumerate(report["rows"]):
        layer, role = label.split(" · ")
        for col, step in enumerate(report["steps"]):
            value = report[name][row][col]
            if value is not None:
                out[(step, layer, role)] = value
    return out
