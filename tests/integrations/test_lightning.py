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


class Block(nn.Module):
    """A ConvNeXt block's shape: depthwise conv, norm, pointwise MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class NetOnly(L.LightningModule):
    """The most common pattern: `training_step` calls `self.net(x)`; no `forward`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), Block(16), Block(16),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BlowUp(L.Callback):
    """Multiplies `net.2.pwconv1`'s weight by 3e5 before step BAD's batch, puts it back
    after; the test's own forward hooks record the first non-finite layer per step."""

    BAD = 2

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.first_bad: dict[int, int | None] = {}
        self.step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step
        if self.step in (self.BAD, self.BAD + 1):
            with torch.no_grad():
                pl_module.net[2].pwconv1.weight.mul_(3e5 if self.step == self.BAD else 1 / 3e5)

    def on_fit_start(self, trainer, pl_module) -> None:
        for layer in self.layers:
            layer.module.register_forward_hook(
                lambda m, a, out, i=layer.index: self._see(i, out))

    def _see(self, index: int, out: torch.Tensor) -> None:
        if self.first_bad.get(self.step) is None and not bool(torch.isfinite(out).all()):
            self.first_bad[self.step] = index


def test_self_net_in_training_step_is_the_forward(offline: Path) -> None:
    """`self.net(x)` never runs the LightningModule's own forward: the forward flags, the
    first bad layer and the autocast dtype still come from the modules that ran."""
    from ampwatch.agent.layers import discover_layers

    module = NetOnly()
    layers = discover_layers(module)
    blow_up = BlowUp(layers)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 3, 32, 32, generator=gen),
                                          torch.randint(0, 4, (48,), generator=gen))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[AmpwatchCallback(sample_every=100), blow_up])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    run_id = next(p.name for p in offline.iterdir())
    steps = spooled_steps(offline, run_id)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    bad = {step for step, layer in blow_up.first_bad.items() if layer is not None}
    assert bad == {BlowUp.BAD}
    assert layers[blow_up.first_bad[BlowUp.BAD]].name == "net.2.pwconv1"
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == \
        {i: blow_up.first_bad.get(i) for i in range(5)}
    assert [s["forward_nonfinite"] is True for s in steps] == [i == BlowUp.BAD for i in range(5)]
    assert {s["autocast_dtype"] for s in steps} == {"float16"}
    assert "activations" in steps[0] and "weight_norm" in steps[0]["spikes"]
