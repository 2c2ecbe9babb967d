"""Training loops as frameworks write them: a disabled GradScaler (nanoGPT's
`GradScaler(enabled=dtype == 'float16')`), `optimizer.step(closure)` (Lightning without a
scaler, LBFGS), autocast entered inside the model's forward (accelerate), the trainer's own
step numbers, gradient checkpointing and custom autograd Functions. Ground truth comes
from the loop itself (its losses, its grads before the optimizer moves them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from tests.agent.factories import batches, mlp, same, spooled, spooled_steps


def grad_norm(model: nn.Module) -> float:
    grads = [p.grad.detach().double().flatten() for p in model.parameters()
             if p.grad is not None]
    return torch.cat(grads).norm().item()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_disabled_scaler_counts_the_loss_once(attach, offline: Path, accumulate: int) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16: nanoGPT's no-op scaler
    attachment = attach(model, scaler)
    truth = []
    step_loss = 0.0
    for i, (x, y) in enumerate(batches(4 * accumulate)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y) / accumulate
        step_loss += loss.item()
        scaler.scale(loss).backward()
        if (i + 1) % accumulate:
            continue
        scaler.unscale_(optimizer)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        truth.append((step_loss, norm.item()))
        step_loss = 0.0
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == 4
    for record, (loss, norm) in zip(steps, truth, strict=True):
        assert same(record["loss"], loss) and same(record["grad_norm"], norm)
        assert record["loss_scale"] is None and record["skipped"] is False


@pytest.mark.parametrize("clip", [None, 1.0])
def test_closure_step_reads_the_grads_the_closure_made(attach, offline: Path,
                                                       clip: float | None) -> None:
    """Lightning bf16 with accumulation 2: the first micro-batch runs outside the step,
    the last one's forward, backward (and clip) inside `optimizer.step(closure)`."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = attach(model)
    data = batches(8)
    truth = []
    for i in range(0, 8, 2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = nn.functional.mse_loss(model(data[i][0]), data[i][1]) / 2
        first.backward()
        seen = {}

        def closure(i: int = i, seen: dict = seen) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(data[i + 1][0]), data[i + 1][1]) / 2
            loss.backward()
            seen["norm"] = grad_norm(model)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            seen["loss"] = loss.item()
            return loss

        optimizer.step(closure)
        optimizer.zero_grad()
        truth.append((first.item() + seen["loss"], seen["norm"]))
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for record, (loss, norm) in zip(steps, truth, strict=True):
        assert same(record["grad_norm"], norm) and same(record["loss"], loss, rel=1e-4)
        assert record["autocast_dtype"] == "bfloat16"
        assert record["clip_before_unscale"] is False
        assert (record["grad_norm_clipped"] is None) == (clip is None)


def test_lbfgs_records_its_first_closure_evaluation(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    attachment = attach(model)
    truth = []
    for x, y in batches(3):
        calls = []

        def closure(x: torch.Tensor = x, y: torch.Tensor = y, calls: list = calls):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            calls.append((loss.item(), grad_norm(model)))
            return loss

        optimizer.step(closure)
        assert len(calls) > 1  # LBFGS evaluated it again: those are not new training data
        truth.append(calls[0])
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == 3
    for record, (loss, norm) in zip(steps, truth, strict=True):
        assert same(record["loss"], loss) and same(record["grad_norm"], norm)


def test_autocast_entered_inside_the_forward_is_recorded(attach, offline: Path) -> None:
    """accelerate wraps `model.forward` in autocast: it is off when the forward begins."""
    model = mlp()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = attach(model)
    for x, y in batches(3):
        nn.functional.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        model(batches(1)[0][0])
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["autocast_dtype"] for s in steps] == ["bfloat16"] * 3
    assert spooled(offline, attachment.run_id)[-1]["run"]["environment"][
        "autocast_dtype"] == "bfloat16"
    attachment.flush()
    assert not [s for s in spooled_steps(offline, attachment.run_id)
                if s.get("eval_forwards_no_autocast")]


def test_steps_carry_the_trainers_numbers(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = attach(model, step=5000, sample_every=10)
    numbers = []
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            attachment.step = 7000  # the loop says which step this is
        numbers.append(attachment.step)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["step"] for s in steps] == numbers == [5000, 5001, 7000, 7001]
    assert "activations" in steps[2] and "activations" not in steps[3]  # 7000 % 10 == 0
    with pytest.raises(ValueError, match="non-negative int"):
        attachment.step = -1
    with pytest.raises(ValueError, match="non-negative int"):
        attach(model, step=1.5)


class Doubling(nn.Module):
    """Multiplies by 1 on a forward and by 100 when run again for the same input (the
    recompute of gradient checkpointing): a recomputed call recorded as a forward would
    show as a 100x larger activation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1.0 if self.calls % 2 else 100.0)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), Doubling(), nn.GELU())
        self.out = nn.Linear(32, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recompute_is_not_a_second_forward(attach, offline: Path,
                                                      reentrant: bool) -> None:
    model = Checkpointed(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, list[float]] = {"forward": []}
    model.block[1].register_forward_hook(
        lambda m, a, out: seen["forward"].append(out.detach().abs().max().item())
        if model.training and m.calls % 2 else None)
    attachment = attach(model, sample_every=1)
    truth = []
    for x, y in batches(3):
        nn.functional.mse_loss(model(x), y).backward()
        truth.append(grad_norm(model))
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush()
    steps = spooled_steps(offline, attachment.run_id)
    layers = [layer["name"] for layer in spooled(offline, attachment.run_id)[-1]["run"]["layers"]]
    doubling = layers.index("block.1")
    assert model.block[1].calls == 6  # the recompute did run
    for record, norm, act in zip(steps, truth, seen["forward"], strict=True):
        assert same(record["grad_norm"], norm)
        assert same(record["activations"]["absmax"][doubling], act)


class ScaledLinear(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class CustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledLinear.apply(x, self.weight)


def test_custom_fwd_layer_is_recorded_once_in_its_own_dtype(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), CustomFn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model, sample_every=1)
    truth = []
    for x, y in batches(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.mse_loss(out.float(), y).backward()
        truth.append((grad_norm(model), out.abs().max().item()))
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush()
    for record, (norm, act) in zip(spooled_steps(offline, attachment.run_id), truth,
                                   strict=True):
        assert same(record["grad_norm"], norm)
        assert record["activations"]["dtype"] == ["bfloat16", "float32"]
        assert same(record["activations"]["absmax"][1], act)
