"""The first layer whose output went inf/NaN, on every architecture of the zoo, from both
designs in which a healthy step reads no layer output: the CPU's replay of the step's
held forward when its loss is bad (the default here), and the accelerator's flagged
checks of the held outputs (bf16 without a scaler, forced on the CPU with
AMPWATCH_DEVICE_PATH=1; the kernel runs in Triton's interpreter).

Before step 3's forward one weight of the middle Linear-like layer goes NaN; AdamW then
spreads the NaN grads into every weight, so step 4 goes bad from its first layer. The
truth is the test's own forward hooks on each layer the agent discovers: the first, in
execution order, whose output held inf/NaN in the training forward."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampwatch.agent.layers import discover_layers
from tests.agent.factories import spooled_steps
from tests.zoo.models import ARCHS, Arch, loss_of

STEPS, AT = 5, 3


def middle_linear(model: nn.Module) -> nn.Module:
    """The middle of the model's Linear-like layers (transformers' GPT-2 Conv1D included)."""
    linear = [m for m in model.modules()
              if isinstance(m, nn.Linear | nn.Conv2d) or type(m).__name__ == "Conv1D"]
    return linear[len(linear) // 2]


class FirstBad:
    """The test's truth: per training forward, the first layer whose output held inf/NaN."""

    def __init__(self, names: dict[nn.Module, str]) -> None:
        self.recording = False  # only the loop's own forward (the agent may replay one)
        self.steps: list[str | None] = []
        for module in names:
            module.register_forward_hook(lambda m, a, out: self._seen(names[m], out))

    def _seen(self, name: str, output: Any) -> None:
        if self.recording and self.steps[-1] is None and not all(
                bool(t.isfinite().all()) for t in float_tensors(output)):
            self.steps[-1] = name


def float_tensors(output: Any) -> list[torch.Tensor]:
    """The floating tensors of a module's output (a tensor, or in a tuple, list, dict or
    transformers' ModelOutput, one level deep)."""
    items = output.values() if isinstance(output, dict) else (
        output if isinstance(output, tuple | list) else [output])
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_the_first_bad_layer_on_every_architecture(arch: Arch, path: str, attach,
                                                   offline: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "device":
        monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    torch.manual_seed(0)
    model = arch.build()
    names = [layer.name for layer in discover_layers(model)]
    truth = FirstBad({layer.module: layer.name for layer in discover_layers(model)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attachment = attach(model, run=f"zoo-first-{arch.name}-{path}", sample_every=100,
                        sample_after_anomaly=0)
    losses = []
    for step in range(STEPS):
        if step == AT:
            with torch.no_grad():
                middle_linear(model).weight.view(-1)[0] = math.nan
        truth.steps.append(None)
        truth.recording = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model(**arch.batch(step)))
        truth.recording = False
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=10)
    assert [math.isfinite(v) for v in losses] == [True] * AT + [False] * (STEPS - AT)
    assert truth.steps[AT] is not None and truth.steps[AT + 1] is not None
    records = spooled_steps(offline, f"zoo-first-{arch.name}-{path}")
    named = [None if r["first_nonfinite_layer"] is None else names[r["first_nonfinite_layer"]]
             for r in records]
    assert named == truth.steps
    # step 0 is sampled (every output read); the other healthy steps read none
    assert [r["forward_nonfinite"] for r in records] == [False, None, None, True, True]
