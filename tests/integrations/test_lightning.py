"""Lightning with `AmpwatchCallback`, end to end on the CPU: a tiny LightningModule in
bf16-mixed (no scaler: the closure path) and in real fp16 with a CPU GradScaler through
`MixedPrecision("16-mixed", "cpu")`, with gradient accumulation and clipping. Ground
truth comes from Lightning's own hooks: the grads in `on_before_optimizer_step` (after
unscaling, before clipping), the scale there, whether the parameters moved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins import MixedPrecision  # noqa: E402

from ampwatch.integrations.lightning import AmpwatchCallback  # noqa: E402
from tests.agent.factories import same, spooled, spooled_steps  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    # lightning 2.6 on torch 2.13 (its own pytree use)
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


class TinyRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Truth(L.Callback):
    """Per optimizer step: global_step, the grad norm Lightning is about to clip, the
    scale in use, and (at batch end) whether the optimizer moved the parameters."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.detach().double().flatten() for p in pl_module.parameters()
                 if p.grad is not None]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append({
            "step": trainer.global_step, "grad_norm": torch.cat(grads).norm().item(),
            "scale": None if scaler is None else scaler.get_scale(),
            "params": [p.detach().clone() for p in pl_module.parameters()]})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps and "params" in self.steps[-1]:
            before = self.steps[-1].pop("params")
            self.steps[-1]["skipped"] = all(
                torch.equal(a, b) for a, b in zip(before, pl_module.parameters(), strict=True))


def fit(precision: dict, accumulate: int, steps: int = 4, logger: Any = False,
        callback: AmpwatchCallback | None = None) -> tuple[TinyRegressor, Truth]:
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=gen),
                                          torch.randn(64, 4, generator=gen))
    module, truth = TinyRegressor(), Truth()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback or AmpwatchCallback(), truth], **precision)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module, truth


def check(offline: Path, module: TinyRegressor, truth: Truth, accumulate: int,
          dtype: str) -> list[dict]:
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    assert [s["step"] for s in steps] == [t["step"] for t in truth.steps] == [0, 1, 2, 3]
    for i, (record, true) in enumerate(zip(steps, truth.steps, strict=True)):
        assert same(record["grad_norm"], true["grad_norm"])  # NaN on an overflowed step
        assert record["skipped"] is true["skipped"]
        micro = module.losses[i * accumulate:(i + 1) * accumulate]
        assert record["loss"] == pytest.approx(sum(micro) / accumulate, rel=1e-5)
        assert record["clip_before_unscale"] is False
        assert same(record["grad_norm_clipped"], min(true["grad_norm"], 1.0))
        assert record["autocast_dtype"] == dtype
    assert spooled(offline, run_id)[-1]["run"]["name"] == "TinyRegressor"
    return steps


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bf16_mixed_reads_grads_after_the_closure(offline: Path, accumulate: int) -> None:
    module, truth = fit({"precision": "bf16-mixed"}, accumulate)
    steps = check(offline, module, truth, accumulate, "bfloat16")
    assert all(s["loss_scale"] is None for s in steps)


def test_fp16_through_the_cpu_scaler_plugin(offline: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    module, truth = fit({"plugins": [plugin]}, accumulate=2)
    steps = check(offline, module, truth, 2, "float16")
    assert [s["loss_scale"] for s in steps] == [t["scale"] for t in truth.steps]
    assert any(t["skipped"] for t in truth.steps)  # the huge initial scale overflowed


def test_mirror_true_writes_into_the_trainers_tensorboard_logger(offline: Path,
                                                                tmp_path: Path) -> None:
    """`AmpwatchCallback(mirror=True)`: ampwatch/ scalars in the TensorBoardLogger's own
    run, at Lightning's global steps, equal to what the test's hooks saw."""
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tiny")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    _, truth = fit({"plugins": [plugin]}, accumulate=2, logger=logger,
                   callback=AmpwatchCallback(mirror=True))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"] if tag.startswith("ampwatch/")}
    assert scalars["ampwatch/loss_scale"] == {t["step"]: t["scale"] for t in truth.steps}
    assert scalars["ampwatch/skipped"] == {t["step"]: float(t["skipped"]) for t in truth.steps}
    assert any(t["skipped"] for t in truth.steps)
    for t in truth.steps:
        assert same(scalars["ampwatch/grad_norm"][t["step"]], t["grad_norm"], rel=1e-6)
