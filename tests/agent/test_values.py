"""Recorded values equal the references: the scaler's own scale, get_total_norm of the
unscaled grads, the steps the optimizer really took."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch.agent.layers import discover_layers
from tests.agent.factories import (
    TinyGPT,
    batches,
    bf16_loop,
    fp16_loop,
    mlp,
    same,
    spooled_steps,
)


@pytest.fixture(autouse=True)
def _both_reductions(reduction: str) -> None:
    """Every test here runs with host-side and with device-side reduction."""


def _norm(grads: list[torch.Tensor]) -> float:
    return float(nn.utils.get_total_norm(grads)) if grads else 0.0


def _layer_norms(model: nn.Module) -> list[float | None]:
    out = []
    for layer in discover_layers(model):
        grads = [p.grad for p in layer.params if p.grad is not None]
        out.append(_norm(grads) if grads else None)
    return out


def test_fp16_with_unscale_and_clip_records_exact_values(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    attachment = attach(model, scaler, sample_every=0)
    stepped: list[bool] = []
    optimizer.register_step_post_hook(lambda *a: stepped.__setitem__(-1, True))
    data = batches(10, bad=lambda i: {3: "inf", 4: "nan"}.get(i))
    refs = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        ref = {"grad_norm": _norm(grads), "layers": _layer_norms(model),
               "loss": float(loss.detach()), "loss_scale": scaler.get_scale()}
        ref["returned"] = float(nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        ref["clipped"] = _norm([p.grad for p in model.parameters() if p.grad is not None])
        stepped.append(False)
        scaler.step(optimizer)
        scaler.update()
        ref["scale_after"] = scaler.get_scale()
        refs.append(ref)
        optimizer.zero_grad(set_to_none=True)
    assert attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)

    assert [s["step"] for s in steps] == list(range(10))
    assert [s["skipped"] for s in steps] == [not s for s in stepped]
    assert any(s["skipped"] for s in steps) and not all(s["skipped"] for s in steps)
    for step, ref in zip(steps, refs, strict=True):
        assert step["loss_scale"] == ref["loss_scale"]
        assert step["scale_after"] == ref["scale_after"]
        assert same(step["grad_norm"], ref["grad_norm"])
        assert same(step["grad_norm"], ref["returned"])
        assert same(step["grad_norm_clipped"], ref["clipped"], rel=1e-4)
        assert same(step["loss"], ref["loss"])
        assert step["lr"] == 0.1
        assert all(same(a, b) for a, b in zip(step["layer_grad_norm"], ref["layers"],
                                              strict=True))
        assert step["clip_before_unscale"] is False
    assert math.isinf(steps[3]["grad_norm"]) or math.isnan(steps[3]["grad_norm"])
    assert steps[3]["input_nonfinite"] and steps[4]["input_nonfinite"]
    assert not steps[0]["input_nonfinite"]


def test_gradient_accumulation_steps_once_per_optimizer_step(attach, offline: Path) -> None:
    model = mlp(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    norms = []

    def before_step(i: int) -> None:
        inv = 1.0 / scaler.get_scale()
        grads = [p.grad * inv for p in model.parameters() if p.grad is not None]
        norms.append(_norm(grads))

    fp16_loop(model, optimizer, scaler, batches(8), accumulate=2, unscale=False,
              on_step=before_step)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(same(s["grad_norm"], n, rel=1e-4) for s, n in zip(steps, norms, strict=True))
    assert [s["scaler_updates"] for s in steps] == [0, 1, 1, 1]
    assert steps[0]["grad_norm_clipped"] is None


def test_bf16_without_scaler_records_clip_norm_and_loss(attach, offline: Path) -> None:
    model = mlp(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model)
    returned = []
    real_clip = nn.utils.clip_grad_norm_

    data = batches(4)
    losses = []
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        returned.append(float(real_clip(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == 4
    for step, norm, loss in zip(steps, returned, losses, strict=True):
        assert same(step["grad_norm"], norm)
        assert same(step["loss"], loss)
        assert step["loss_scale"] is None and step["scale_after"] is None
        assert step["skipped"] is False
        assert step["scaler_updates"] is None
        assert step["autocast_dtype"] == "bfloat16"
        assert same(step["grad_norm_clipped"], min(norm, 0.5), rel=1e-4)


def test_fp32_loop_has_no_autocast_dtype(attach, offline: Path) -> None:
    model = mlp(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model)
    bf16_loop(model, optimizer, batches(3), autocast=False)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["autocast_dtype"] for s in steps] == [None, None, None]
    assert all(s["grad_norm"] > 0 for s in steps)


def test_tied_weights_count_once_in_total_and_in_each_layer(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx).float().logsumexp(-1).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total = _norm([p.grad for p in model.parameters()])
    layers = _layer_norms(model)
    scaler.step(optimizer)
    scaler.update()
    attachment.flush(5)
    (step,) = spooled_steps(offline, attachment.run_id)
    assert same(step["grad_norm"], total)
    assert all(same(a, b) for a, b in zip(step["layer_grad_norm"], layers, strict=True))


def test_deprecated_cuda_grad_scaler_on_cpu_only_machine(attach, offline: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("covers the disabled scaler of CPU-only machines")
    with pytest.warns(FutureWarning), pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.cuda.amp.GradScaler()
    model = mlp(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model, scaler)
    fp16_loop(model, optimizer, scaler, batches(3), dtype=torch.bfloat16)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["skipped"] for s in steps] == [False] * 3
    assert all(s["loss_scale"] is None and s["grad_norm"] > 0 for s in steps)


@pytest.mark.parametrize("scaled", [True, False], ids=["fp16-scaler", "bf16"])
def test_training_is_bitwise_unchanged_by_the_agent(attach, scaled: bool) -> None:
    weights = []
    for use_agent in (False, True):
        model = mlp(7)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        if use_agent:
            attach(model, scaler, sample_every=1)
        data = batches(6, bad=lambda i: "inf" if i == 3 else None)
        if scaler is not None:
            fp16_loop(model, optimizer, scaler, data, clip=0.5, scheduler=scheduler)
        else:
            bf16_loop(model, optimizer, data[:3], clip=0.5)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
