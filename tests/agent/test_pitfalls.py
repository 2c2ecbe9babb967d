"""The loop facts behind the AMP pitfalls of the reference table."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.agent.factories import batches, bf16_loop, fp16_loop, mlp, spooled_steps


def _steps(attachment, offline: Path) -> list[dict]:
    attachment.flush(5)
    return spooled_steps(offline, attachment.run_id)


def test_clip_before_unscale_is_flagged(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    fp16_loop(model, optimizer, scaler, batches(2), clip=1.0, unscale=False)
    fp16_loop(model, optimizer, scaler, batches(1), clip=1.0, unscale=True)
    steps = _steps(attachment, offline)
    assert [s["clip_before_unscale"] for s in steps] == [True, True, False]
    assert steps[0]["grad_norm_clipped"] is None and steps[2]["grad_norm_clipped"] is not None


def test_another_models_clip_is_not_the_watched_loops(attach, offline: Path) -> None:
    """A second model in the process (a discriminator, an EMA, a plain copy) clipping
    its own grads says nothing about the watched loop: no pitfall, and the watched
    step's clipped norm is its own clip's."""
    model, other = mlp(), mlp(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    for x, y in batches(3):
        nn.functional.mse_loss(other(x), y).backward()
        nn.utils.clip_grad_norm_(other.parameters(), 1e-3)
        other_optimizer.step()
        other_optimizer.zero_grad()
        fp16_loop(model, optimizer, scaler, [(x, y)], clip=1e9)
    steps = _steps(attachment, offline)
    assert [s["clip_before_unscale"] for s in steps] == [False, False, False]
    assert all(s["grad_norm_clipped"] == s["grad_norm"] for s in steps)  # max_norm 1e9


def test_scheduler_steps_and_updates_since_previous_step(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    attachment = attach(model, scaler)
    data = batches(4, bad=lambda i: "inf" if i == 1 else None)
    fp16_loop(model, optimizer, scaler, data, scheduler=scheduler)
    scaler.update(2.0**10)  # pitfall 11: an extra update without a step
    fp16_loop(model, optimizer, scaler, batches(1))
    steps = _steps(attachment, offline)
    assert steps[1]["skipped"] is True
    # the scheduler step after skipped step 1 shows up in step 2's record
    assert [s["scheduler_steps"] for s in steps] == [0, 1, 1, 1, 1]
    assert [s["scaler_updates"] for s in steps] == [0, 1, 1, 1, 2]
    assert [s["lr"] for s in steps] == [0.01, 0.005, 0.0025, 0.00125, 0.000625]


def test_eval_forwards_without_autocast_are_counted(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model)
    bf16_loop(model, optimizer, batches(1))
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 16))
    model.train()
    bf16_loop(model, optimizer, batches(1))
    steps = _steps(attachment, offline)
    assert [s["eval_forwards"] for s in steps] == [0, 2]
    assert [s["eval_forwards_no_autocast"] for s in steps] == [0, 1]


def test_mixed_autocast_dtypes_within_a_step(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model)
    x, y = batches(1)[0]
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
    optimizer.step()
    steps = _steps(attachment, offline)
    assert steps[0]["autocast_dtype"] == "mixed"
    assert steps[0]["t_forward_ms"] > 0 and steps[0]["t_backward_ms"] > 0
