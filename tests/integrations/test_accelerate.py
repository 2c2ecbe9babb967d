"""A hand-written Accelerate loop with `attach_accelerator`: accelerate enters autocast
inside the prepared model's forward and owns the scaler; values come from the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

from ampwatch.integrations.accelerate import attach_accelerator  # noqa: E402
from tests.agent.factories import batches, mlp, same, spooled_steps  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def test_bf16_accelerate_loop(offline: Path) -> None:
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True,
                                         gradient_accumulation_steps=2)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    attachment = attach_accelerator(accelerator, model)
    truth, step_loss = [], 0.0
    for x, y in batches(8):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x).float(), y)
            step_loss += loss.item() / 2  # accelerator.backward divides by the accumulation
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                truth.append((step_loss, norm.item()))
                step_loss = 0.0
            optimizer.step()
            optimizer.zero_grad()
    attachment.detach()
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == len(truth) == 4
    for record, (loss, norm) in zip(steps, truth, strict=True):
        assert same(record["grad_norm"], norm) and same(record["loss"], loss, rel=1e-4)
        assert record["autocast_dtype"] == "bfloat16"


def test_mirror_true_writes_into_the_accelerators_tensorboard_tracker(
        offline: Path, tmp_path: Path) -> None:
    """`attach_accelerator(..., mirror=True)` with `log_with="tensorboard"`: ampwatch/
    scalars in the tracker's own run, each step's grad norm the loop's own."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True,
                                         log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("tiny")
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    attachment = attach_accelerator(accelerator, model, mirror=True)
    norms = []
    for x, y in batches(4):
        accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    attachment.detach()
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "tiny"))
    events.Reload()
    mirrored = {e.step: e.value for e in events.Scalars("ampwatch/grad_norm")}
    assert sorted(mirrored) == [0, 1, 2, 3]
    for step, norm in enumerate(norms):
        assert mirrored[step] == pytest.approx(norm, rel=1e-6)
